"""`temper run` with the policy's engine in a child process (``local.engine: process``):
the run samples through the CPU model server over the loopback, every sampled turn's
logprobs are its labelled version's (recomputed here from the registry's weights), the
child is gone when the run ends, and a child that cannot start says why at once."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
import yaml

from services.embedded import runner
from services.embedded.engine_process import EngineProcess
from services.launcher.resources import free_port
from temper.runtime import StartupError
from temper.storage import LocalStore
from tests.faults import content
from tests.services.embedded.test_temper_run import small_spec


def children_naming(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (the engine's model directory)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "cpu_server" in cmdline and str(path) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_samples_through_its_engine_process_and_the_logprobs_are_each_versions(tmp_path):
    path = small_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["schedule"]["iterations"] = 3
    spec.pop("evaluation")
    spec["local"]["engine"] = "process"
    path.write_text(yaml.safe_dump(spec))
    run = asyncio.run(runner.run(path, runs_dir=tmp_path / "runs", run_id="proc", out=io.StringIO()))
    assert run.state == "completed"
    assert (run.run_dir / "engine.log").exists()
    assert not children_naming(run.run_dir), "the engine process outlived its run"
    check = asyncio.run(
        content.check(
            f"sqlite+aiosqlite:///{run.run_dir / 'temper.db'}",
            LocalStore(run.run_dir / "objects"),
            [run.job_id],
            rescore=2,
        )
    )
    print(f"\n{check.summary()}")  # noqa: T201 - what the checks saw
    assert check.tags_checked == 24 and sum(check.samples_checked.values()) > 0
    assert not check.mislabelled, check.problems
    assert check.logprobs.checked > 0 and check.logprobs.max_abs < 1e-4
    assert check.rescored == 2 and not check.disagreements, check.disagreements


@pytest.mark.timeout(120)
def test_an_engine_process_that_cannot_start_says_why(tmp_path):
    engine = EngineProcess(tmp_path, tmp_path / "no-such-model", port=free_port(), max_batch=4, threads=1)
    with pytest.raises(
        StartupError,
        match=r"the engine process exited with 1 before it answered: FileNotFoundError: .*no-such-model is not a model directory",
    ):
        engine.start()
    assert engine.proc is not None and engine.proc.poll() is not None
