"""The chaos workload's pieces the content checks rely on: the digest step.py prints is the
one computed from a snapshot of the same workspace, and a re-score is compared component by
component with the stated tolerance for efficiency only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from temper.events import RewardComponent
from temper.sandbox.snapshot import pack
from tests.faults import workload
from tests.faults.content import _components_differ


def run_step(workspace: Path, k: int) -> str:
    out = subprocess.run(
        [sys.executable, "-c", workload.CODE.format(k=k)],
        cwd=workspace,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    printed = workload.printed_digest(out)
    assert printed is not None, out
    return printed


def test_step_py_prints_the_digest_of_the_workspace_a_snapshot_of_it_holds(tmp_path):
    task = workload.tasks()[1]
    for path, content in task["files"].items():
        (tmp_path / path).write_text(content)
    files = {p: c.encode() for p, c in task["files"].items()}
    assert run_step(tmp_path, 2) == workload.workspace_digest(files)  # the first turn: the task's files
    snapshot = workload.snapshot_files(pack(tmp_path))  # what the worker stores after the turn
    assert set(snapshot) == {"step.py", "journal.txt", "solution.py"}
    assert snapshot["solution.py"] == b"def scale(x):\n    return x * 2\n"
    assert run_step(tmp_path, 3) == workload.workspace_digest(snapshot)  # the next turn: the snapshot's
    assert run_step(tmp_path, 3) != workload.workspace_digest(snapshot)  # the journal grew


def test_the_teacher_calls_the_tool_on_every_turn_with_a_digit():
    for _, turns in workload.warm_start_examples(50):
        calls = turns[::2]
        assert all(c.startswith("<tool_call>") and "k = " in c for c in calls)
        assert len(turns) % 2 == 1 and len(calls) <= workload.MAX_TURNS


def test_a_rescore_differs_in_any_component_but_efficiency_within_its_tolerance():
    stored = {
        "tests_passed": {"value": 1.0, "ok": True},
        "efficiency": {"value": 0.95, "ok": True, "details": {"agent_s": 1e-5}},
    }

    def fresh(**changes: RewardComponent) -> dict[str, RewardComponent]:
        out = {"tests_passed": RewardComponent(value=1.0), "efficiency": RewardComponent(value=0.9)}
        return {**out, **changes}

    tol = workload.EFFICIENCY_TOLERANCE
    assert _components_differ(stored, fresh(), tol) == []  # 0.05 apart, details aside
    assert _components_differ(stored, fresh(efficiency=RewardComponent(value=0.95 - tol - 0.01)), tol)
    assert _components_differ(stored, fresh(efficiency=RewardComponent(ok=False, reason="x")), tol)
    assert _components_differ(stored, fresh(tests_passed=RewardComponent(value=0.9999)), tol)
    assert _components_differ(stored, {**fresh(), "compiles": RewardComponent(value=1.0)}, tol) == [
        "compiles: only in the re-score"
    ]
