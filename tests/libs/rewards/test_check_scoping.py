"""A split check keeps the scoping of the function it was cut from: its assignments
stay local (the solution's module is untouched), helpers close over its locals, a
failing test does not stop the next, and each failure quotes its own line."""

from __future__ import annotations

import pytest

from temper.rewards import Scorer
from temper.tasks.models import TaskSpec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(90)]

TESTS = """
def check(candidate):
    str = "shadowed"
    assert candidate(1) == "1"
    seen = []
    def remember(x):
        seen.append(x)
        return candidate(x)
    assert remember(2) == "2" and seen == [2]
    assert candidate(3) == "three"
    assert all(remember(x) == f"{x}" for x in (4, 5)) and seen == [2, 4, 5]
    assert str == "shadowed"
"""
SOLUTION = "def show(x):\n    return str(x)\n\ndef leaked():\n    return [k for k in globals() if k in ('seen', 'remember', 'candidate')]\n"
TASK = TaskSpec(id="scoping", prompt="show(x)", entry_point="show", tests=TESTS, solution=SOLUTION)


async def test_check_locals_stay_local_and_each_test_reports_alone(scoring_manager):
    _, comps = await Scorer(scoring_manager).score(TASK, {"files": {"solution.py": SOLUTION}})
    tests = comps["tests_passed"].details["tests"]
    assert [t["passed"] for t in tests] == [True, True, False, True, True], tests
    # quoted from the check as the harness runs it (ast.unparse writes single quotes)
    assert tests[2]["message"] == "assertion failed: assert candidate(3) == 'three'", tests[2]
    assert comps["tests_passed"].value == pytest.approx(0.8)


async def test_the_solution_module_gains_no_names_from_the_check():
    from temper.rewards.testsplit import split_tests

    split = split_tests(TESTS + "\n    assert candidate.__globals__.get('str') is None\n", "show")
    program = split.program or ""
    assert program.startswith("def __temper_check__(candidate):")
    namespace: dict[str, object] = {}
    exec(SOLUTION, namespace)
    exec(program, namespace)
    gen = namespace.pop("__temper_check__")(namespace["show"])  # type: ignore[operator]
    outcomes = list(gen)
    assert [o is None for o in outcomes] == [True, True, False, True, True, True]
    assert namespace["leaked"]() == [] and "str" not in namespace  # type: ignore[operator]
