"""The test runner on real sandboxes: one action per score (the files travel with the
harness's spec), a place no earlier score touched for every score, and a test that kills the one test
process still reported as that test's failure."""

from __future__ import annotations

import pytest

from temper.rewards import Scorer, ScoringError
from temper.sandbox import Action, SandboxLimits
from temper.tasks.models import TaskSpec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(90)]

TESTS = (
    "def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 2\n"
    "    assert candidate(3) == 3\n    assert candidate(4) == 4\n"
)
TASK = TaskSpec(
    id="ident",
    prompt="ident(x)",
    entry_point="ident",
    solution="def ident(x):\n    return x\n",
    tests=TESTS,
    files={"data/table.txt": "1 2 3 4\n", "README.md": "starting file"},
)


def _count_runs(manager) -> list[Action]:
    actions: list[Action] = []
    run_fresh = manager.run_fresh

    async def counted(limits, files, action, fetch=()):
        actions.append(action)
        return await run_fresh(limits, files, action, fetch)

    manager.run_fresh = counted
    return actions


async def test_a_score_is_one_action_and_the_solution_sees_every_file(scoring_manager):
    runs = _count_runs(scoring_manager)
    solution = (
        "import os\nTABLE = open('data/table.txt').read().split()\n"
        "assert open('README.md').read() == 'starting file' and os.path.exists('helper.py')\n"
        "from helper import twice\n"
        "def ident(x):\n    return int(TABLE[x - 1]) * twice(1) // 2\n"
    )
    files = {"solution.py": solution, "helper.py": "def twice(x):\n    return 2 * x\n"}
    _, comps = await Scorer(scoring_manager).score(TASK, {"files": files})
    assert comps["tests_passed"].value == 1.0, comps["tests_passed"].details
    assert comps["compiles"].value == 1.0
    assert [a.kind for a in runs] == ["run_python"]  # one run, no write_file round trips


async def test_every_score_runs_where_no_earlier_score_was():
    """One zygote serves all four scores: each finds neither the workspace file nor the
    /tmp file the score before it wrote (either would make ident return -1)."""
    import shutil
    import uuid
    from pathlib import Path

    from temper import metrics
    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager, SandboxSettings

    root = Path("/tmp") / f"temper-score-{uuid.uuid4().hex[:8]}"  # the sandbox uid must reach it
    manager = SandboxManager(
        scoring_sandbox_settings(SandboxSettings(pool_size=0, zygotes=1, workspace_root=root))
    )
    await manager.start()
    try:
        on_zygotes = metrics.SANDBOX_FRESH_RUNS.labels("zygote")._value.get()
        solution = (
            "import os\nLEFT = sorted(p for p in ('mark', '/tmp/mark') if os.path.exists(p))\n"
            "for p in ('mark', '/tmp/mark'):\n    open(p, 'w').write('x')\n"
            "def ident(x):\n    return x if not LEFT else -1\n"
        )
        scorer = Scorer(manager)
        for _ in range(4):
            _, comps = await scorer.score(TASK, {"files": {"solution.py": solution}})
            assert comps["tests_passed"].value == 1.0, comps["tests_passed"].details
        assert metrics.SANDBOX_FRESH_RUNS.labels("zygote")._value.get() - on_zygotes == 4
        assert manager.zygotes.started == 1
    finally:
        await manager.close()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_test_that_kills_the_process_is_that_tests_failure(scoring_manager):
    tests = (
        "def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(0) == 0\n"
        "    assert candidate(3) == 3\n"
    )
    task = TASK.model_copy(update={"tests": tests, "files": {}})
    solution = "import os\ndef ident(x):\n    if x == 0:\n        os._exit(3)\n    return x\n"
    _, comps = await Scorer(scoring_manager).score(task, {"files": {"solution.py": solution}})
    tests_out = comps["tests_passed"].details["tests"]
    assert [t["passed"] for t in tests_out] == [True, False, False]
    assert tests_out[1]["message"].startswith("the test process ended early")
    assert tests_out[2]["message"].startswith("not run")
    assert comps["tests_passed"].value == pytest.approx(1 / 3)


async def test_files_that_cannot_be_written_are_a_scoring_error(scoring_manager):
    scorer = Scorer(scoring_manager)
    small = TASK.model_copy(update={"limits": SandboxLimits(file_size_mb=1, wall_s=20, cpu_s=20)})
    with pytest.raises(ScoringError, match="file larger than file_size_mb"):
        await scorer.score(small, {"files": {"solution.py": "x = 1\n", "big.txt": "x" * (2 << 20)}})
    with pytest.raises(ScoringError, match="cannot write README.md/solution.py"):
        await scorer.score(TASK, {"files": {"README.md/solution.py": "x = 1\n", "solution.py": "x = 1\n"}})


async def test_coverage_is_one_action_ignores_the_workspaces_config_and_a_compile_error_scores_0(
    scoring_manager,
):
    actions = _count_runs(scoring_manager)
    scorer = Scorer(scoring_manager)
    weights = {"tests_passed": 1.0, "coverage": 0.5}
    half = "def ident(x):\n    if x > 100:\n        return 0\n    return x\n"  # the branch to 0 never runs
    gaming = {
        ".coveragerc": "[report]\nexclude_lines =\n    .*\n",
        "pyproject.toml": "[tool.coverage.report]\nexclude_lines = ['.*']\n",
    }
    _, comps = await scorer.score(TASK, {"files": {"solution.py": half, **gaming}}, weights)
    cov = comps["coverage"]
    assert cov.ok and cov.details["statements"] == 4 and cov.details["covered_lines"] == 3, cov
    assert 0 < cov.value < 1 and cov.details["missing_lines"] == [3]
    # tests and coverage: one action each (each score its own fresh sandbox)
    assert sorted(a.kind for a in actions) == ["run_command", "run_python"]
    _, comps = await scorer.score(TASK, {"files": {"solution.py": "def ident(x) return x\n"}}, weights)
    assert comps["coverage"].value == 0.0 and "does not compile" in (comps["coverage"].reason or "")
