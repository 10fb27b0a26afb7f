"""The sandbox worker against the real Kafka and S3 servers with the real bwrap backend:
a multi-action session over ``sandbox.requests``/``sandbox.results``, and a session
that survives its worker being SIGKILLed, through the snapshot in S3.

The topics are shared with other tests and benches on the same broker: each test uses
its own consumer groups, starts them at the end of the topics, and only looks at
results for its own episode ids."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from services.sandbox_worker.component import SandboxWorkerComponent
from temper.bus.kafka import start_groups_at_end
from temper.events import Message, SandboxRequest, SandboxResult, Topics
from temper.runtime import Runtime
from temper.sandbox import SandboxLimits, SandboxSettings
from temper.settings import BusKind, BusSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.sandbox, pytest.mark.timeout(120)]

LIMITS = SandboxLimits(wall_s=5, cpu_s=5, memory_mb=128, pids=64, output_bytes=32 << 10, workspace_mb=16)


@pytest.fixture
def root():
    # Under /tmp (mode 1777): the sandbox uid must reach the workspaces.
    path = Path("/tmp") / f"temper-sbk-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settings_for(bootstrap: str, s3, root: Path, group: str) -> Settings:
    return Settings(
        bus=BusSettings(kind=BusKind.kafka, bootstrap=bootstrap),
        storage=s3,
        sandbox=SandboxSettings(pool_size=1, default_limits=LIMITS, workspace_root=root, group=group),
    )


class Results:
    """Sandbox results for our own episodes only."""

    def __init__(self, episodes: set[str]) -> None:
        self.episodes = episodes
        self.items: dict[tuple[str, int], SandboxResult] = {}
        self.changed = asyncio.Event()

    async def __call__(self, message: Message) -> None:
        if isinstance(message, SandboxResult) and message.episode_id in self.episodes:
            self.items[(message.episode_id, message.turn or 0)] = message
            self.changed.set()

    async def get(self, episode: str, turn: int, limit_s: float = 60) -> SandboxResult:
        async with asyncio.timeout(limit_s):
            while (episode, turn) not in self.items:
                self.changed.clear()
                await self.changed.wait()
        return self.items[(episode, turn)]


async def client_runtime(bootstrap: str, s3, root: Path, unique: str, results: Results) -> Runtime:
    """The test's own runtime: it sends requests and reads results from the end of the topic."""
    runtime = Runtime(
        settings_for(bootstrap, s3, root, f"unused-{unique}"), service="sbk-test", needs_db=False
    )
    await runtime.start()
    group = f"sbk-results-{unique}"
    await start_groups_at_end(bootstrap, {group: [Topics.SANDBOX_RESULTS]})
    await runtime.consume([Topics.SANDBOX_RESULTS], results, group=group)
    return runtime


def step(episode: str, turn: int, action: dict, **fields: object) -> SandboxRequest:
    return SandboxRequest(
        job_id="sbk", episode_id=episode, turn=turn, session_id=episode, action=action, **fields
    )


async def test_multi_action_session_over_kafka(kafka_bootstrap, s3_settings, root, unique) -> None:
    episodes = {f"sbk-{unique}-{i}" for i in range(2)}
    results = Results(episodes)
    client = await client_runtime(kafka_bootstrap, s3_settings, root, unique, results)
    group = f"sandbox-worker-{unique}"
    await start_groups_at_end(kafka_bootstrap, {group: [Topics.SANDBOX_REQUESTS]})
    wruntime = Runtime(
        settings_for(kafka_bootstrap, s3_settings, root, group), service="sandbox-worker", needs_db=False
    )
    await wruntime.start()
    service = SandboxWorkerComponent(wruntime, worker_id=f"w-{unique}")
    await service.start()
    bus = client.bus
    assert bus is not None
    try:
        for i, ep in enumerate(sorted(episodes)):
            await bus.send_message(
                Topics.SANDBOX_REQUESTS,
                step(
                    ep,
                    0,
                    {"kind": "run_command", "command": "cat task.txt"},
                    files={"task.txt": f"task {i}\n"},
                ),
            )
        for i, ep in enumerate(sorted(episodes)):
            r = await results.get(ep, 0)
            assert r.error is None and r.result["stdout"] == f"task {i}\n" and r.worker == f"w-{unique}"
            await bus.send_message(
                Topics.SANDBOX_REQUESTS,
                step(
                    ep,
                    1,
                    {"kind": "write_file", "path": "sol.py", "content": f"print({i} * 10)\n"},
                    snapshot_key=r.snapshot_key,
                ),
            )
            await bus.send_message(
                Topics.SANDBOX_REQUESTS, step(ep, 2, {"kind": "run_command", "command": "python3 sol.py; ls"})
            )
            await bus.send_message(
                Topics.SANDBOX_REQUESTS,
                step(ep, 3, {"kind": "run_python", "code": "import os; print(sorted(os.listdir('/')))"}),
            )
            await bus.send_message(Topics.SANDBOX_REQUESTS, step(ep, 4, {"kind": "destroy"}))
        for i, ep in enumerate(sorted(episodes)):
            r2 = await results.get(ep, 2)
            assert r2.result["stdout"] == f"{i * 10}\nsol.py\ntask.txt\n"
            r3 = await results.get(ep, 3)
            assert (
                r3.result["exit_code"] == 0
                and "workspace" in r3.result["stdout"]
                and "root" not in r3.result["stdout"]
            )
            r4 = await results.get(ep, 4)
            assert r4.error is None
            # Snapshots of every step are in S3 under the session's prefix.
            assert r2.snapshot_key and await client.store.get(r2.snapshot_key)
        assert not service.worker.manager.sessions
    finally:
        await service.stop()
        await wruntime.stop()
        await client.stop()
    assert service.worker.manager.leaked == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "services.sandbox_worker"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if str(path) in line]


async def test_session_survives_a_sigkilled_worker_through_its_snapshot(
    kafka_bootstrap, s3_settings, postgres_url, root, unique, tmp_path
) -> None:
    ep = f"sbk-kill-{unique}"
    results = Results({ep})
    client = await client_runtime(kafka_bootstrap, s3_settings, root, unique, results)
    bus = client.bus
    assert bus is not None
    group = f"sandbox-worker-{unique}"
    await start_groups_at_end(kafka_bootstrap, {group: [Topics.SANDBOX_REQUESTS]})
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    env.update(
        TEMPER_MODE="distributed",
        TEMPER_DB__URL=postgres_url,  # required by distributed settings; the worker has no database
        TEMPER_LOG__LEVEL="WARNING",
        TEMPER_PORT=str(port),
        TEMPER_BUS__BOOTSTRAP=kafka_bootstrap,
        TEMPER_STORAGE__ENDPOINT=s3_settings.endpoint,
        TEMPER_STORAGE__ACCESS_KEY=s3_settings.access_key,
        TEMPER_STORAGE__SECRET_KEY=s3_settings.secret_key.get_secret_value(),
        TEMPER_STORAGE__BUCKET=s3_settings.bucket,
        TEMPER_SANDBOX__GROUP=group,
        TEMPER_SANDBOX__POOL_SIZE="1",
        TEMPER_SANDBOX__WORKSPACE_ROOT=str(root),
        PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
    )
    log = tmp_path / "worker-a.log"
    proc = spawn_worker(env, log)
    b_runtime: Runtime | None = None
    b: SandboxWorkerComponent | None = None
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(120):
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health", timeout=5)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            step(
                ep,
                0,
                {"kind": "run_command", "command": "mkdir -p notes && echo first > notes/a.txt"},
                files={"task.md": "do it\n"},
            ),
        )
        r0 = await results.get(ep, 0)
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            step(
                ep,
                1,
                {"kind": "write_file", "path": "notes/b.txt", "content": "second\n"},
                snapshot_key=r0.snapshot_key,
            ),
        )
        r1 = await results.get(ep, 1)
        worker_a = r1.worker
        assert r0.error is None and r1.error is None and r1.snapshot_key and worker_a
        assert mounts_under(root), "worker A holds its workspaces"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        # Worker B joins the same group; the next turn names the latest snapshot.
        b_runtime = Runtime(
            settings_for(kafka_bootstrap, s3_settings, root, group), service="sandbox-worker", needs_db=False
        )
        await b_runtime.start()
        b = SandboxWorkerComponent(b_runtime, worker_id=f"b-{unique}")
        await b.start()
        assert not [m for m in mounts_under(root) if f"/w{proc.pid}-" in m], (
            "B swept the dead worker's mounts"
        )
        await bus.send_message(
            Topics.SANDBOX_REQUESTS,
            step(
                ep,
                2,
                {"kind": "run_command", "command": "cat task.md notes/a.txt notes/b.txt"},
                snapshot_key=r1.snapshot_key,
                files={"task.md": "overwritten?\n"},
            ),
        )
        r2 = await results.get(ep, 2, limit_s=90)
        assert r2.worker == f"b-{unique}" != worker_a
        assert r2.error is None and r2.result["stdout"] == "do it\nfirst\nsecond\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if b is not None:
            await b.stop()
        if b_runtime is not None:
            await b_runtime.stop()
        await client.stop()
    assert b.worker.manager.leaked == 0
    assert mounts_under(root) == []
