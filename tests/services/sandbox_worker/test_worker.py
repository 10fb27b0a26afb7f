"""The SandboxWorkerComponent component on a Runtime with the in-process bus and a local
store, on the real bwrap backend: requests in, results out, starting files only in
fresh sessions, and the consumer paused while the worker is full."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest

from services.sandbox_worker.component import SandboxWorkerComponent
from temper.events import Message, SandboxRequest, SandboxResult, Topics
from temper.runtime import Runtime
from temper.sandbox import Action, SandboxLimits, SandboxSettings
from temper.settings import BusKind, BusSettings, Settings, StorageKind, StorageSettings

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]

LIMITS = SandboxLimits(wall_s=3, cpu_s=3, memory_mb=128, pids=64, output_bytes=32 << 10, workspace_mb=16)


@pytest.fixture
def root():
    path = Path("/tmp") / f"temper-sbs-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settings(tmp_path: Path, root: Path, **sandbox: object) -> Settings:
    return Settings(
        bus=BusSettings(kind=BusKind.inprocess, partitions=2, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp_path / "objects"),
        sandbox=SandboxSettings(pool_size=1, default_limits=LIMITS, workspace_root=root, **sandbox),
        data_dir=tmp_path,
    )


class Results:
    """Collects sandbox results from the bus."""

    def __init__(self) -> None:
        self.items: list[SandboxResult] = []
        self.arrived = asyncio.Event()

    async def __call__(self, message: Message) -> None:
        if isinstance(message, SandboxResult):
            self.items.append(message)
            self.arrived.set()

    async def wait(self, n: int, limit_s: float = 20) -> list[SandboxResult]:
        async with asyncio.timeout(limit_s):
            while len(self.items) < n:
                self.arrived.clear()
                await self.arrived.wait()
        return self.items


def request(episode: str, turn: int, action: dict, **fields: object) -> SandboxRequest:
    return SandboxRequest(episode_id=episode, turn=turn, session_id=episode, action=action, **fields)


async def test_requests_in_results_out_with_starting_files_only_in_fresh_sessions(tmp_path, root) -> None:
    runtime = Runtime(settings(tmp_path, root), service="sandbox-worker", needs_db=False)
    await runtime.start()
    service = SandboxWorkerComponent(runtime, worker_id="a")
    await service.start()
    results = Results()
    await runtime.consume([Topics.SANDBOX_RESULTS], results, group="test-results")
    bus = runtime.bus
    assert bus is not None
    files = {"README.md": "start here\n", "src/app.py": "print('app')\n"}
    try:
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request(
                "ep",
                0,
                {"kind": "run_command", "command": "cat README.md; python3 src/app.py > out.txt"},
                files=files,
            ),
        )
        (r0,) = await results.wait(1)
        assert r0.error is None and r0.result["stdout"] == "start here\n" and r0.worker == "a"
        assert r0.snapshot_key and r0.episode_id == "ep" and r0.turn == 0
        # The session is held: the files are not written again over the agent's work.
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request(
                "ep",
                1,
                {"kind": "run_command", "command": "echo edited > README.md; cat out.txt"},
                files={"README.md": "again\n"},
            ),
        )
        r1 = (await results.wait(2))[1]
        assert r1.result["stdout"] == "app\n"
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("ep", 2, {"kind": "read_file", "path": "README.md"}, files={"README.md": "again\n"}),
        )
        r2 = (await results.wait(3))[2]
        assert r2.result["content"] == "edited\n"
        # A broken snapshot key is an error result, not a crash or a dead letter.
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("other", 0, {"kind": "list_files"}, snapshot_key="sandbox-snapshots/none.tar.gz"),
        )
        r3 = (await results.wait(4))[3]
        assert r3.error and "not found" in r3.error
    finally:
        await service.stop()
        await runtime.stop()
    assert service.worker.manager.leaked == 0 and not service.worker.manager.sessions

    # Another worker restores the session from the snapshot; the starting files in the
    # request must not overwrite what the agent wrote.
    runtime = Runtime(settings(tmp_path, root), service="sandbox-worker", needs_db=False)
    await runtime.start()
    b = SandboxWorkerComponent(runtime, worker_id="b")
    await b.start()
    try:
        r = await b.worker.handle(
            request(
                "ep",
                3,
                {"kind": "run_command", "command": "cat README.md out.txt; ls src"},
                snapshot_key=r2.snapshot_key,
                files=files,
            )
        )
        assert r.error is None and r.worker == "b"
        assert r.result["stdout"] == "edited\napp\napp.py\n"
    finally:
        await b.stop()
        await runtime.stop()


async def test_consumer_pauses_while_the_worker_is_full(tmp_path, root) -> None:
    runtime = Runtime(settings(tmp_path, root, concurrency=1), service="sandbox-worker", needs_db=False)
    await runtime.start()
    service = SandboxWorkerComponent(runtime)
    await service.start()
    results = Results()
    await runtime.consume([Topics.SANDBOX_RESULTS], results, group="test-results")
    assert runtime.bus is not None
    try:
        worker = service.worker
        sid = await worker.manager.create_session()
        # An HTTP action takes the only slot: the consumer must stop fetching.
        busy = asyncio.create_task(worker.act(sid, Action(kind="run_command", command="sleep 0.6")))
        await asyncio.sleep(0.1)
        assert worker.full and service.consumer.paused and service.pauses == 1
        await runtime.bus.send_message(
            Topics.SANDBOX_REQUESTS, request("ep-p", 0, {"kind": "run_python", "code": "print(6 * 7)"})
        )
        await asyncio.sleep(0.2)
        assert results.items == [], "handled while the worker was full"
        await busy
        (r,) = await results.wait(1)
        assert r.result["stdout"] == "42\n" and not service.consumer.paused
        health = await runtime.health()
        assert health["sandbox_worker"] == "ok"
    finally:
        await service.stop()
        await runtime.stop()
    assert "sandbox_worker" not in runtime.checks


async def test_a_session_on_a_task_image_and_a_missing_image(tmp_path, root) -> None:
    from temper.sandbox.images import publish
    from tests.libs.sandbox.conftest import debian_blob

    # A fresh image cache: the worker's first session on the image pulls it from the store.
    cache = root / "images"
    runtime = Runtime(settings(tmp_path, root, image_cache=cache), service="sandbox-worker", needs_db=False)
    await runtime.start()
    digest = await publish(runtime.store, debian_blob(), source={"test": "worker"})
    service = SandboxWorkerComponent(runtime, worker_id="a")
    await service.start()
    results = Results()
    await runtime.consume([Topics.SANDBOX_RESULTS], results, group="test-results")
    bus = runtime.bus
    assert bus is not None
    imaged = {**LIMITS.model_dump(), "image": digest}
    missing = {**LIMITS.model_dump(), "image": "sha256:" + "cd" * 32}
    try:
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("img", 0, {"kind": "run_command", "command": "git init -q r && git -C r status --short && echo ok"},
                    limits=imaged),
        )  # fmt: skip
        (r0,) = await results.wait(1, limit_s=60)
        assert r0.error is None and r0.result["stdout"] == "ok\n", r0
        assert digest in service.worker.manager.images.pulls and (cache / f"sha256-{digest[7:]}").is_dir()
        await bus.send_message(
            Topics.SANDBOX_REQUESTS, request("gone", 0, {"kind": "list_files"}, limits=missing)
        )
        r1 = (await results.wait(2))[1]
        assert (
            r1.error is not None and "sha256:" + "cd" * 32 in r1.error and "not in object storage" in r1.error
        )
    finally:
        await service.stop()
        await runtime.stop()


async def test_setup_runs_once_in_a_fresh_session_before_the_action_and_a_failing_one_is_an_error(
    tmp_path, root
) -> None:
    """An environment package's setup: after the starting files, before the first action,
    not again in the held session; a setup that fails fails the step with its output."""
    runtime = Runtime(settings(tmp_path, root), service="sandbox-worker", needs_db=False)
    await runtime.start()
    service = SandboxWorkerComponent(runtime, worker_id="a")
    await service.start()
    results = Results()
    await runtime.consume([Topics.SANDBOX_RESULTS], results, group="test-results")
    bus = runtime.bus
    assert bus is not None
    setup = [{"kind": "run_command", "command": "cat seed.txt >> log.txt; echo setup >> log.txt"}]
    try:
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("ok", 0, {"kind": "run_command", "command": "cat log.txt"}, files={"seed.txt": "seed\n"},
                    setup=setup),
        )  # fmt: skip
        (r0,) = await results.wait(1)
        assert r0.error is None and r0.result["stdout"] == "seed\nsetup\n", r0
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("ok", 1, {"kind": "run_command", "command": "cat log.txt"}, setup=setup),
        )
        r1 = (await results.wait(2))[1]
        assert r1.result["stdout"] == "seed\nsetup\n", r1  # the held session: setup did not run again
        failing = [{"kind": "run_command", "command": "echo no database >&2; exit 4"}]
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            request("bad", 0, {"kind": "run_command", "command": "true"}, setup=failing),
        )
        r2 = (await results.wait(3))[2]
        assert r2.error == "setup failed: exit status 4: no database", r2
        assert "bad" not in service.worker.manager.sessions
    finally:
        await service.stop()
        await runtime.stop()
