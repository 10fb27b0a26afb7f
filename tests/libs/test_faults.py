"""The fault points (temper.faults): off unless TEMPER_FAULTS is set, and then an armed
point holds every operation that reaches it until it is disarmed or its process killed."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from temper import faults
from temper.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import asyncio, sys
from temper import faults
async def main():
    print("on" if faults.ON else "off", flush=True)
    await faults.hold("trainer.step", work=3, job_id="j1", step=7)
    print("went on", flush=True)
asyncio.run(main())
"""


def holder(directory: Path | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_FAULTS"}
    if directory is not None:
        env["TEMPER_FAULTS"] = str(directory)
    env["PYTHONPATH"] = str(ROOT / "libs")
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(predicate, timeout_s: float = 20.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_off_without_the_variable_touches_nothing(monkeypatch):
    """This process has no TEMPER_FAULTS: hold is the coroutine that returns at once, and it
    reads no file even for a point that does not exist."""
    assert "TEMPER_FAULTS" not in os.environ
    assert faults.ON is False and faults.hold is faults._off

    def no_filesystem(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the filesystem was touched")

    monkeypatch.setattr(Path, "exists", no_filesystem)
    monkeypatch.setattr(os, "stat", no_filesystem)
    import asyncio

    asyncio.run(faults.hold("no.such.point", work=5))


def test_an_unarmed_point_lets_the_operation_through(tmp_path):
    proc = holder(tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["on", "went", "on"]
    assert faults.held(tmp_path, "trainer.step") == []


def test_an_armed_point_holds_until_disarmed(tmp_path):
    faults.arm(tmp_path, "trainer.step")
    proc = holder(tmp_path)
    try:
        [doc] = wait_for(lambda: faults.held(tmp_path, "trainer.step"))
        assert doc["pid"] == proc.pid and doc["work"] == 3
        assert doc["ids"] == {"job_id": "j1", "step": 7}
        time.sleep(0.3)
        assert proc.poll() is None, "an armed point let the operation go on"
        faults.disarm(tmp_path, "trainer.step")
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out.split() == ["on", "went", "on"]
    assert faults.held(tmp_path, "trainer.step") == []  # the operation removed its own marker


def test_a_process_killed_while_held_leaves_nothing_after_disarm(tmp_path):
    faults.arm(tmp_path, "trainer.step")
    proc = holder(tmp_path)
    wait_for(lambda: faults.held(tmp_path, "trainer.step"))
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["on"]  # it never went on
    assert len(faults.held(tmp_path, "trainer.step")) == 1
    faults.disarm(tmp_path, "trainer.step")
    assert faults.held(tmp_path, "trainer.step") == []


def test_only_known_points_can_be_armed(tmp_path):
    with pytest.raises(ValueError, match="no fault point 'trainer.nap'"):
        faults.arm(tmp_path, "trainer.nap")


def test_services_reach_each_point_with_one_call_and_nothing_else_of_the_module():
    """Every use of temper.faults under services/ and libs/ is ``await faults.hold("<a known
    point>", ...)``; every point is used; TEMPER_FAULTS is no setting (no route, message or
    setting reaches a fault point)."""
    used: dict[str, list[str]] = {}
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("libs/temper/**/*.py")]:
        if path.name == "faults.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "faults"
            ):
                assert node.attr == "hold", f"{path}: faults.{node.attr}"
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "hold"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "faults"
            ):
                point = node.args[0]
                assert isinstance(point, ast.Constant) and point.value in faults.POINTS, (
                    path,
                    ast.dump(point),
                )
                used.setdefault(point.value, []).append(str(path.relative_to(ROOT)))
    assert sorted(used) == sorted(faults.POINTS), used
    assert "faults" not in Settings.model_fields
