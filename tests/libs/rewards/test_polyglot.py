"""Rewards in every language, on real sandboxes: a task's hidden tests in its own language,
each test reported alone through the scorer as for Python (``tests_passed`` and its
per-test details, ``compiles``); the example task sets of every compiled language (and the
scripted ones) pass the validation pipeline (each reference passes every test, an empty
file fails)."""

from __future__ import annotations

from pathlib import Path

import pytest

from temper.limits import LanguageName as L
from temper.limits import SandboxLimits
from temper.rewards import Scorer
from temper.tasks.models import SOLUTION_FILES, TaskSpec, parse_tasks
from temper.tasks.validation import check_task

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240)]

# language -> (tests, a right solution, a wrong one: x + 1, and a crash or an exception for x < 0)
CASES: dict[L, tuple[str, str, str]] = {
    L.c: (
        "assert(f(1) == 2);\nassert(f(2) == 4);\nassert(f(-1) == -2);\nassert(f(3) == 6);\n",
        "int f(int x) { return 2 * x; }\n",
        "int f(int x) { if (x < 0) { volatile int *p = 0; return *p; } return x + 1; }\n",
    ),
    L.cpp: (
        "assert(f(1) == 2);\nassert(f(2) == 4);\nassert(f(-1) == -2);\nassert(f(3) == 6);\n",
        "int f(int x) { return 2 * x; }\n",
        '#include <stdexcept>\nint f(int x) { if (x < 0) throw std::out_of_range("negative"); return x + 1; }\n',
    ),
    L.java: (
        'assert Solution.f(1) == 2;\nassert Solution.f(2) == 4 : "f(2)";\nassert Solution.f(-1) == -2;\n'
        "assert Solution.f(3) == 6;\n",
        "public class Solution { public static int f(int x) { return 2 * x; } }\n",
        "public class Solution {\n  public static int f(int x) {\n"
        '    if (x < 0) throw new IllegalArgumentException("negative");\n    return x + 1;\n  }\n}\n',
    ),
    L.go: (
        'assert(F(1) == 2)\nassert(F(2) == 4, "F(2)")\nassertEqual(F(-1), -2)\nassertEqual(F(3), 6)\n',
        "package main\n\nfunc F(x int) int { return 2 * x }\n",
        "package main\n\nfunc F(x int) int {\n\tif x < 0 {\n\t\tvar xs []int\n\t\treturn xs[-x]\n\t}\n\treturn x + 1\n}\n",
    ),
    L.rust: (
        "assert_eq!(f(1), 2);\nassert_eq!(f(2), 4);\nassert_eq!(f(-1), -2);\nassert!(f(3) == 6);\n",
        "fn f(x: i32) -> i32 { 2 * x }\n",
        'fn f(x: i32) -> i32 { if x < 0 { panic!("negative") } x + 1 }\n',
    ),
    L.nodejs: (
        "const assert = require('node:assert');\nassert.strictEqual(f(1), 2);\nassert.strictEqual(f(2), 4);\n"
        "assert.strictEqual(f(-1), -2);\nassert(f(3) === 6);\n",
        "function f(x) { return 2 * x; }\n",
        "function f(x) { if (x < 0) throw new RangeError('negative'); return x + 1; }\n",
    ),
    L.typescript: (
        "import * as assert from 'assert';\nassert.strictEqual(f(1), 2);\nassert.strictEqual(f(2), 4);\n"
        "assert.strictEqual(f(-1), -2);\nassert.ok(f(3) === 6);\n",
        "function f(x: number): number { return 2 * x; }\n",
        "function f(x: number): number { if (x < 0) { throw new RangeError('negative'); } return x + 1; }\n",
    ),
    L.bash: (
        '[[ $(f 1) = 2 ]]\n[ "$(f 2)" = 4 ]\n[[ $(f -1) = -2 ]]\ntest "$(f 3)" = 6\n',
        "f() { echo $(( 2 * $1 )); }\n",
        "f() { if (( $1 < 0 )); then exit 3; fi; echo $(( $1 + 1 )); }\n",
    ),
}
# What the wrong solution's failures say: test 2 (a wrong value), test 3 (the crash or exception)
MESSAGES = {
    L.c: ("assertion failed: f(2) == 4", "killed by signal 11"),
    L.cpp: ("assertion failed: f(2) == 4", "exception: negative"),
    L.java: ("assertion failed: f(2)", "java.lang.IllegalArgumentException: negative"),
    L.go: ("assertion failed: F(2)", "panic: runtime error: index out of range [1] with length 0"),
    L.rust: ("assertion failed: `(left == right)`", "negative"),
    L.nodejs: ("assertion failed: Expected values to be strictly equal", "RangeError: negative"),
    L.typescript: ("assertion failed: Expected values to be strictly equal", "RangeError: negative"),
    L.bash: ("test failed (exit status 1)", "test failed (exit status 1)"),
}


def task_of(language: L, tests: str, solution: str) -> TaskSpec:
    return TaskSpec(id=f"f-{language}", prompt="f(x) = 2x", language=language, tests=tests, solution=solution)


@pytest.mark.parametrize("language", list(CASES), ids=str)
async def test_each_test_is_scored_alone_in_the_tasks_language(scoring_manager, language):
    tests, right, wrong = CASES[language]
    task = task_of(language, tests, right)
    assert task.solution_file == SOLUTION_FILES[language] != "solution.py"
    scorer = Scorer(scoring_manager)
    _, good = await scorer.score(task, {"files": {task.solution_file: right}})
    assert good["tests_passed"].value == 1.0, good["tests_passed"]
    assert good["compiles"].value == 1.0
    _, bad = await scorer.score(task, {"files": {task.solution_file: wrong}})
    details = bad["tests_passed"].details
    assert bad["tests_passed"].value == 0.25, details  # only f(1) == 2 holds for x + 1
    assert [t["passed"] for t in details["tests"]] == [True, False, False, False]
    assert details["tests"][0]["name"].startswith("test 1 (line ")
    wrong_value, crash = MESSAGES[language]
    assert wrong_value in details["tests"][1]["message"], details["tests"][1]
    assert crash in details["tests"][2]["message"], details["tests"][2]
    assert bad["tests_passed"].reason.startswith("test 2 (line ")
    # the crash or exception ended only its own test: the one after it ran (3 + 1 != 6)
    assert (
        "not run" not in details["tests"][3]["message"]
        and "ended early" not in details["tests"][3]["message"]
    )
    assert bad["compiles"].value == 1.0


@pytest.mark.parametrize(
    ("language", "broken", "says"),
    [
        (L.cpp, "int f(int x) { return 2 * x }\n", "solution.cpp:1"),
        (L.rust, "fn f(x: i32) -> i32 { 2 * y }\n", "cannot find value `y`"),
        (L.go, 'package main\n\nfunc F(x int) int { return "no" }\n', "solution.go"),
        (
            L.java,
            'public class Solution { public static int f(int x) { return "no"; } }\n',
            "incompatible types",
        ),
    ],
)
async def test_a_solution_that_does_not_compile_scores_zero_with_the_compilers_words(
    scoring_manager, language, broken, says
):
    tests, right, _ = CASES[language]
    task = task_of(language, tests, right)
    _, comps = await Scorer(scoring_manager).score(task, {"files": {task.solution_file: broken}})
    assert comps["compiles"].value == 0.0 and says in comps["compiles"].reason, comps["compiles"]
    assert comps["tests_passed"].value == 0.0
    assert all(t["message"].startswith("does not compile: ") for t in comps["tests_passed"].details["tests"])


async def test_c_tests_have_their_own_timer_and_two_timeouts_stop_the_rest(scoring_manager):
    tests = "assert(f(1) == 1);\nassert(f(0) == 0);\nassert(f(2) == 2);\nassert(f(-1) == -1);\nassert(f(3) == 3);\n"
    slow = "int f(int x) { if (x <= 0) { for (;;) {} } return x; }\n"
    task = task_of(L.c, tests, "int f(int x) { return x; }\n")
    runner = Scorer(scoring_manager).runner
    runner.settings.per_test_s = 0.3
    runs, _ = await runner.run(task, [("slow", slow)])
    messages = [t.message for t in runs[0].tests]
    assert [t.passed for t in runs[0].tests] == [True, False, True, False, False]
    assert messages[1] == messages[3] == "timeout: the test ran past 0.3s"
    assert messages[4] == "not run: earlier tests timed out"
    assert runs[0].kill_reason is None


async def test_a_hanging_test_in_go_ends_the_run_and_the_tests_before_it_count(scoring_manager):
    tests = "assert(F(1) == 1)\nassert(F(0) == 0)\nassert(F(2) == 2)\n"
    hang = "package main\n\nfunc F(x int) int {\n\tfor x == 0 {\n\t}\n\treturn x\n}\n"
    task = TaskSpec(
        id="hang", prompt="F(x) = x", language=L.go, tests=tests, solution="package main\n\nfunc F(x int) int { return x }\n",
        limits=SandboxLimits(wall_s=3, cpu_s=3, memory_mb=512, pids=64),
    )  # fmt: skip
    _, comps = await Scorer(scoring_manager).score(task, {"files": {"solution.go": hang}})
    tests_passed = comps["tests_passed"]
    outcomes = tests_passed.details["tests"]
    assert [t["passed"] for t in outcomes] == [True, False, False]
    assert tests_passed.details["kill_reason"] in ("timeout", "cpu")
    assert outcomes[1]["message"].startswith("killed by the sandbox: ")
    assert outcomes[2]["message"].startswith("not run: ")


@pytest.mark.parametrize("name", ["c", "cpp", "java", "go", "rust", "scripting"])
async def test_the_example_task_sets_validate(scoring_manager, name):
    path = EXAMPLES / "tasksets" / f"{name}-basics.yaml"
    tasks = parse_tasks(path.read_text(), filename=path.name)
    runner = Scorer(scoring_manager).runner
    assert {t.language for t in tasks} <= set(L) - {L.python}
    for task in tasks:
        assert await check_task(runner, task) == [], task.id
        runs, _ = await runner.run(task, [("reference", task.solution), ("empty", "")])
        assert runs[0].all_passed and len(runs[0].tests) >= 3, (task.id, runs[0])
        assert runs[1].passed == 0, (task.id, runs[1])
