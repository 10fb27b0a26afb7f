"""A session is never reaped under a live episode: a step's ``keep_s`` (the time to the
episode's deadline) keeps it past the worker's idle expiry. Only a worker holding
``max_sessions`` kept sessions evicts one for a new session (the least recently used,
counted; its episode restores it from its snapshot)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest

from services.sandbox_worker.component import SandboxWorkerComponent
from temper.events import SandboxRequest
from temper.runtime import Runtime
from temper.sandbox import SandboxLimits, SandboxSettings
from temper.settings import BusKind, BusSettings, Settings, StorageKind, StorageSettings

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]

LIMITS = SandboxLimits(wall_s=3, cpu_s=3, memory_mb=128, pids=64, output_bytes=32 << 10, workspace_mb=16)
IDLE_S = 0.3  # the worker's idle expiry; its reaper looks every 0.075 s


@pytest.fixture
async def worker(tmp_path: Path):  # noqa: ANN201
    root = Path("/tmp") / f"temper-keep-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        bus=BusSettings(kind=BusKind.inprocess, partitions=2, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp_path / "objects"),
        sandbox=SandboxSettings(
            pool_size=0, default_limits=LIMITS, workspace_root=root, idle_expiry_s=IDLE_S, max_sessions=2
        ),
        data_dir=tmp_path,
    )
    runtime = Runtime(settings, service="sandbox-worker", needs_db=False)
    await runtime.start()
    service = SandboxWorkerComponent(runtime, worker_id="k")
    await service.start()
    try:
        yield service.worker
    finally:
        await service.stop()
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)


def step(episode: str, turn: int, command: str, **fields: object) -> SandboxRequest:
    return SandboxRequest(
        episode_id=episode,
        turn=turn,
        session_id=episode,
        action={"kind": "run_command", "command": command},
        snapshot_after=False,  # nothing to restore from: a reaped session would lose the file
        **fields,
    )


async def test_a_kept_session_outlives_the_idle_expiry_and_then_expires(worker) -> None:  # noqa: ANN001
    kept = await worker.handle(step("live", 0, "echo mine > marker", keep_s=2.0))
    plain = await worker.handle(step("plain", 0, "echo mine > marker"))
    assert kept.error is None and plain.error is None
    await asyncio.sleep(1.0)  # more than three idle expiries: the model thinks, the session waits
    assert "live" in worker.manager.sessions and "plain" not in worker.manager.sessions
    again = await worker.handle(step("live", 1, "cat marker", keep_s=0.5))
    assert again.error is None and again.result["stdout"] == "mine\n", "the same session, not a new one"
    await asyncio.sleep(1.5)  # its keep (0.5 s from the step) and its idle expiry both passed
    assert "live" not in worker.manager.sessions


async def test_when_every_session_is_kept_the_least_recently_used_makes_room(worker) -> None:  # noqa: ANN001
    from temper import metrics

    before = metrics.SANDBOX_KEPT_EVICTED._value.get()
    for episode in ("a", "b"):  # max_sessions: 2
        r = await worker.handle(step(episode, 0, "true", keep_s=30.0))
        assert r.error is None
    await worker.handle(step("a", 1, "true", keep_s=30.0))  # b is now the least recently used
    r = await worker.handle(step("c", 0, "true", keep_s=30.0))
    assert r.error is None and set(worker.manager.sessions) == {"a", "c"}
    assert metrics.SANDBOX_KEPT_EVICTED._value.get() == before + 1
