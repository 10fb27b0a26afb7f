"""Each component on real sandboxes."""

from __future__ import annotations

import pytest

from temper.rewards import Scorer, combine
from temper.rewards.models import Submission
from temper.tasks.models import TaskSpec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(90)]

TASK = TaskSpec(
    id="abs",
    prompt="Write absdiff(a, b)",
    entry_point="absdiff",
    solution="def absdiff(a, b):\n    if a > b:\n        return a - b\n    return b - a\n",
    tests="def check(candidate):\n    assert candidate(3, 1) == 2\n    assert candidate(1, 3) == 2\n"
    "    assert candidate(2, 2) == 0\n    assert candidate(-1, 1) == 2\n",
)
MATH = TaskSpec(id="m", kind="math", prompt="6*7?", answer="42")


async def test_a_correct_solution_scores_full_marks_on_every_component(scoring_manager):
    scorer = Scorer(scoring_manager)
    weights = {
        "tests_passed": 1.0,
        "compiles": 0.1,
        "coverage": 0.2,
        "efficiency": 0.1,
        "format": 0.1,
        "turn_penalty": -0.1,
    }
    reward, comps = await scorer.score(
        TASK, {"files": {"solution.py": TASK.solution}}, weights, turns_used=1, max_turns=4
    )
    assert comps["tests_passed"].value == 1.0 and comps["tests_passed"].details["total"] == 4
    assert comps["compiles"].value == 1.0
    cov = comps["coverage"]
    assert (
        cov.ok
        and cov.details["line"] == 1.0
        and cov.details["branch"] == 1.0
        and cov.details["branches"] == 2
    )
    assert comps["efficiency"].ok and 0.5 <= comps["efficiency"].value <= 1.0
    assert comps["turn_penalty"].value == 0.0
    assert reward == pytest.approx(1.0 + 0.1 + 0.2 + 0.1 * comps["efficiency"].value + 0.1)


async def test_partial_solutions_get_the_fraction_of_tests_and_partial_branch_coverage(scoring_manager):
    scorer = Scorer(scoring_manager)
    code = "def absdiff(a, b):\n    if a > b:\n        return a - b\n    return 0\n"
    named = ["tests_passed", "coverage", "efficiency"]  # weighted 0 but asked for: measured
    reward, comps = await scorer.score(
        TASK,
        {"files": {"solution.py": code}},
        {"tests_passed": 1.0, "coverage": 0.0, "efficiency": 0.0},
        only=named,
    )
    tp = comps["tests_passed"]
    assert tp.value == 0.5 and tp.details["passed"] == 2
    failed = [t for t in tp.details["tests"] if not t["passed"]]
    assert failed[0]["name"].startswith("assert 2: assert candidate(1, 3) == 2")
    assert "assertion failed" in failed[0]["message"]
    assert comps["coverage"].details["line"] == 1.0
    assert not comps["efficiency"].ok and "tests failed" in comps["efficiency"].reason
    assert reward == 0.5


async def test_expensive_components_weighted_zero_cost_no_run_unless_asked_for(scoring_manager):
    scorer = Scorer(scoring_manager)
    runs: list[dict[str, object]] = []
    run = scorer.runner.run

    async def counted(*args, **kwargs):
        runs.append(kwargs)
        return await run(*args, **kwargs)

    scorer.runner.run = counted  # type: ignore[method-assign]
    weights = {"tests_passed": 1.0, "coverage": 0.0, "efficiency": 0.0}
    reward, comps = await scorer.score(TASK, {"files": {"solution.py": TASK.solution}}, weights)
    assert reward == 1.0 and "coverage" not in comps and "efficiency" not in comps
    # one run of the tests, not timed: no coverage run, no reference run, no repeats
    assert len(runs) == 1 and runs[0].get("repeat", 1) == 1 and not runs[0].get("coverage")


async def test_code_that_does_not_compile_loops_or_raises(scoring_manager):
    scorer = Scorer(scoring_manager)
    _, comps = await scorer.score(TASK, {"files": {"solution.py": "def absdiff(a, b) return 1\n"}})
    assert comps["compiles"].value == 0.0 and "SyntaxError" in comps["compiles"].reason
    assert comps["tests_passed"].value == 0.0 and "does not compile" in comps["tests_passed"].reason
    _, comps = await scorer.score(
        TASK, {"files": {"solution.py": "def absdiff(a, b):\n    raise ValueError('no')\n"}}
    )
    assert comps["tests_passed"].value == 0.0
    assert "ValueError: no" in comps["tests_passed"].details["tests"][0]["message"]
    _, comps = await scorer.score(
        TASK, {"text": "```python\ndef absdiff(a, b):\n    while True:\n        pass\n```"}
    )
    msgs = [t["message"] for t in comps["tests_passed"].details["tests"]]
    assert msgs[0].startswith("timeout") and msgs[-1].startswith("not run")


async def test_prints_cannot_forge_results_and_missing_code_is_explained(scoring_manager):
    scorer = Scorer(scoring_manager)
    forge = 'print(\'x {"ev": "test", "label": "agent", "i": 0, "ok": true}\')\ndef absdiff(a, b):\n    return 0\n'
    _, comps = await scorer.score(TASK, {"files": {"solution.py": forge}})
    assert comps["tests_passed"].value == 0.25  # only candidate(2, 2) == 0 passes
    reward, comps = await scorer.score(TASK, {"text": "I could not do it"})
    assert reward == 0.0 and comps["tests_passed"].reason == "no code submitted"


async def test_math_format_turns_and_unmeasurable_components_give_reasons(scoring_manager):
    scorer = Scorer(scoring_manager)
    weights = {"answer_match": 1.0, "format": 0.5, "turn_penalty": -0.5, "coverage": 1.0, "nonsense": 1.0}
    reward, comps = await scorer.score(
        MATH, {"text": "6*7 = 42, so \\boxed{42}"}, weights, turns_used=3, max_turns=3, format_ok=False
    )
    assert comps["answer_match"].value == 1.0
    assert comps["format"].value == 0.0 and comps["format"].reason
    assert comps["turn_penalty"].value == 1.0
    assert not comps["coverage"].ok and "does not apply to math" in comps["coverage"].reason
    assert not comps["nonsense"].ok and "unknown reward component" in comps["nonsense"].reason
    assert reward == pytest.approx(1.0 - 0.5)
    assert combine(weights, comps)[1] == ["coverage", "nonsense"]
    _, comps = await scorer.score(MATH, Submission(answer="41"))
    assert comps["answer_match"].value == 0.0 and "41" in comps["answer_match"].reason


async def test_scoring_never_writes_into_the_sandbox_of_the_agent_and_tests_are_not_files(scoring_manager):
    scorer = Scorer(scoring_manager)
    snoop = (
        "import os\nFOUND = [f for f in os.listdir('.') + os.listdir('/tmp')]\n"
        "def absdiff(a, b):\n    assert not any('check' in open(f).read() for f in FOUND if os.path.isfile(f) and f != 'solution.py'), FOUND\n"
        "    return abs(a - b)\n"
    )
    _, comps = await scorer.score(TASK, {"files": {"solution.py": snoop}})
    assert comps["tests_passed"].value == 1.0, comps["tests_passed"].details
