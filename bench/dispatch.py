"""Dispatcher orchestration overhead per turn, over the real stack (Kafka + Postgres),
for this checkout and a baseline, measured alternately in one run.

Bench-local doubles of the peers answer at once: a stub policy (a ``true`` shell
command until the last turn, then ``submit``), a no-op sandbox and a constant reward.
They run in a process of their own, as the real services do. So a turn's wall time is
all orchestration: two Kafka round trips (inference, sandbox) and two Postgres
transactions that record a result and write the next command, published as they commit.
A turn is measured from the step rows: the time between the dispatcher issuing one
inference request of an episode and issuing the next. Measured next to the raw Kafka
produce→consume hop of the same run; the dispatcher process's CPU time per turn is
reported too, and the machine's: every process a turn runs through (the dispatcher, the
peers, the Postgres backends of the bench's database and Postgres's own background
processes, the Kafka broker), from /proc over the throughput run. Kafka's and
Postgres's background processes serve the other users of the shared servers as well, so
on a busy machine that figure is an upper bound.

The machine is shared and noisy, so one invocation measures both: ``--rounds`` times the
baseline (``--baseline``, a git commit: by default main before the hot path went on the
driver, unpacked with ``git archive`` into a temporary directory) and then this checkout, each
in a fresh process, with the load average before and after each. The table and the
JSON give the median of each side (``baseline_*`` keys for the baseline) and every
round's figures.

    python bench/dispatch.py            # make bench-dispatch
    python bench/dispatch.py --rounds 1 --baseline none   # this checkout only
    python bench/dispatch.py --episodes 512 --concurrency 128

Writes bench/results/dispatch.json (flat JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import logging
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# BENCH_CODE=DIR measures the checkout in DIR (its libs and services) with this script;
# an environment variable, so the peers' spawned process imports the same code.
CODE = Path(os.environ.get("BENCH_CODE") or ROOT)
sys.path[:0] = [str(CODE / "libs"), str(CODE)]

import asyncpg  # noqa: E402
import sqlalchemy  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from services.dispatcher.component import Dispatcher  # noqa: E402
from temper import metrics  # noqa: E402
from temper.bus import Record  # noqa: E402
from temper.bus.kafka import KafkaBus, start_groups_at_end  # noqa: E402
from temper.clock import utcnow  # noqa: E402
from temper.db import Episode, Job, Step, Task, TaskSet, Tenant  # noqa: E402
from temper.db.migrate import upgrade  # noqa: E402
from temper.events import (  # noqa: E402
    InferenceRequest,
    InferenceResult,
    RewardComponent,
    RewardRequest,
    RewardResult,
    SandboxRequest,
    SandboxResult,
    Topics,
    decode,
)
from temper.jobspec import JobSpec  # noqa: E402
from temper.policy.tokenizer import default_tokenizer  # noqa: E402
from temper.runtime import Runtime  # noqa: E402
from temper.settings import (  # noqa: E402
    BusKind,
    BusSettings,
    DatabaseSettings,
    DispatcherSettings,  # noqa: E402
    Settings,
    StorageKind,
    StorageSettings,
)

TOK = default_tokenizer()
# The dispatcher before its hot path went on the driver (issue 29): main at 1dbc647, the one
# data path on SQLAlchemy Core (f43815c is the code before that). Both wake the scheduler
# on finished episodes, so both are measured with the service's fallback tick.
BASELINE = "1dbc647"
RUN_TEXT = "```bash\ntrue\n```"
SUBMIT_TEXT = "submit"


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """A process's user + system CPU time so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def kafka_pids() -> list[int]:
    """The Kafka broker's JVM (its command line names kafka.Kafka)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"kafka.Kafka" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class MachineCpu:
    """CPU time of every process a turn runs through, over an interval: this process
    (the dispatcher), the peers, the Postgres backends of the bench's database and
    Postgres's background processes, and the Kafka broker."""

    def __init__(self, admin_url: str, database: str, peers_pid: int) -> None:
        self.admin_url, self.database, self.peers_pid = admin_url, database, peers_pid

    async def _postgres_pids(self) -> list[int]:
        conn = await asyncpg.connect(self.admin_url)
        try:
            rows = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 OR backend_type <> 'client backend'",
                self.database,
            )
        finally:
            await conn.close()
        return [r["pid"] for r in rows]

    async def sample(self) -> dict[str, float]:
        postgres = await self._postgres_pids()
        return {
            "dispatcher": time.process_time(),
            "peers": proc_cpu_s(self.peers_pid),
            **{f"postgres:{pid}": proc_cpu_s(pid) for pid in postgres},
            **{f"kafka:{pid}": proc_cpu_s(pid) for pid in kafka_pids()},
        }

    @staticmethod
    def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """Seconds each part used between two samples (a backend that started in between
        counts from 0; its own connection to ask is not among them)."""
        out = {"dispatcher": 0.0, "peers": 0.0, "postgres": 0.0, "kafka": 0.0}
        for key, value in after.items():
            part = key.split(":", 1)[0]
            out[part] += max(0.0, value - before.get(key, 0.0))
        return out


class StackSampler:
    """A sampling profile of this process's CPU: on every ``interval_s`` of the process's
    CPU time (``ITIMER_PROF``) a signal handler records the main thread's stack. cProfile
    charges coroutine frames oddly (every resume is a call) and triples the run's CPU; a
    thread that samples waits for the GIL and sees mostly calls that release it. These
    samples fall where the CPU goes."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.stacks: Counter[tuple[str, ...]] = Counter()

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ANN001 - a frame
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{self._where(code.co_filename)}:{code.co_name}")
            frame = frame.f_back
        self.stacks[tuple(reversed(names))] += 1

    @staticmethod
    def _where(filename: str) -> str:
        """A file by its package path (``sqlalchemy/orm/session.py``, ``services/...``)."""
        for marker in ("site-packages/", f"{CODE}/libs/", f"{CODE}/"):
            if marker in filename:
                return filename.split(marker, 1)[1]
        return Path(filename).name

    def start(self) -> None:
        signal.signal(signal.SIGPROF, self._on_signal)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)

    def dump(self, path: str) -> None:
        """The inclusive share of busy samples per function, most first, and the stacks."""
        busy = dict(self.stacks)
        total = max(1, sum(busy.values()))
        inclusive: Counter[str] = Counter()
        for stack, n in busy.items():
            for name in set(stack):
                inclusive[name] += n
        doc = {
            "samples": sum(self.stacks.values()),
            "busy": total,
            "inclusive_share": [(name, round(n / total, 4)) for name, n in inclusive.most_common(400)],
            "stacks": [[list(s), n] for s, n in Counter(busy).most_common(5000)],
        }
        Path(path).write_text(json.dumps(doc, indent=1))


def run_loop(main: Any) -> Any:
    """``main`` on the event loop the measured checkout's services run on
    (``temper.eventloop``; a checkout from before it existed ran asyncio's own)."""
    try:
        from temper import eventloop
    except ImportError:
        return asyncio.run(main)
    return eventloop.run(main)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class StubPeers:
    """Policy, sandbox and scorer doubles, on a bus of their own: instant, or (bench/scale.py)
    a policy that answers after ``policy_delay_s`` = (low, high) seconds, drawn per turn, as
    a long LLM call does. A delayed answer is sent from a task of its own, so thousands
    can wait at once without holding a consumer slot."""

    def __init__(
        self, bus: KafkaBus, max_turns: int, prefix: str, policy_delay_s: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.bus = bus
        self.max_turns = max_turns
        self.prefix = prefix
        self.policy_delay_s = policy_delay_s
        self.consumers = []
        self.waiting: set[asyncio.Task] = set()

    async def start(self, suffix: str) -> None:
        for topic in (Topics.INFERENCE_REQUESTS, Topics.SANDBOX_REQUESTS, Topics.REWARD_REQUESTS):
            self.consumers.append(
                await self.bus.subscribe([topic], f"bench-{topic}-{suffix}", self.on_request, concurrency=8)
            )

    async def stop(self) -> None:
        for c in self.consumers:
            await c.stop()

    async def on_request(self, record: Record) -> None:
        msg = decode(record.value)
        if not (msg.job_id or "").startswith(self.prefix):
            return
        ids = dict(job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt)
        if isinstance(msg, InferenceRequest):
            text = SUBMIT_TEXT if msg.turn + 1 >= self.max_turns else RUN_TEXT
            tokens = [*TOK.encode(text), TOK.stop_ids[0]]
            answer = InferenceResult(
                **ids, token_ids=tokens, logprobs=[-0.1] * len(tokens), text=text, finish_reason="stop"
            )
            low, high = self.policy_delay_s
            if high <= 0:
                await self.bus.send_message(Topics.INFERENCE_RESULTS, answer)
            else:
                task = asyncio.create_task(self._answer_later(random.uniform(low, high), answer))
                self.waiting.add(task)
                task.add_done_callback(self.waiting.discard)
        elif isinstance(msg, SandboxRequest):
            await self.bus.send_message(
                Topics.SANDBOX_RESULTS,
                SandboxResult(
                    **ids, session_id=msg.session_id, result={"exit_code": 0, "wall_s": 0.0}, worker="noop"
                ),
            )
        elif isinstance(msg, RewardRequest):
            await self.bus.send_message(
                Topics.REWARD_RESULTS,
                RewardResult(
                    **ids,
                    task_id=msg.task_id,
                    reward=1.0,
                    components={"tests_passed": RewardComponent(value=1.0)},
                ),
            )

    async def _answer_later(self, delay_s: float, answer: InferenceResult) -> None:
        await asyncio.sleep(delay_s)
        await self.bus.send_message(Topics.INFERENCE_RESULTS, answer)


def run_peers(
    bootstrap: str,
    partitions: int,
    max_turns: int,
    prefix: str,
    suffix: str,
    ready,
    stop,
    policy_delay_s: tuple[float, float] = (0.0, 0.0),
) -> None:
    """The peers' process: in a deployment they are other services, so their CPU is not
    the dispatcher's."""

    async def main() -> None:
        logging.disable(logging.WARNING)
        bus = KafkaBus(bootstrap=bootstrap, partitions=partitions)
        await bus.start()
        peers = StubPeers(bus, max_turns, prefix, policy_delay_s)
        await peers.start(suffix)
        ready.set()
        await asyncio.to_thread(stop.wait)
        await peers.stop()
        await bus.stop()

    run_loop(main())


def run_replica(
    index: int,
    url: str,
    bootstrap: str,
    partitions: int,
    pool_size: int,
    data_dir: str,
    dispatcher_settings: dict,
    stats_dir: str,
    ready,
    stop,
) -> None:
    """One dispatcher replica in a process of its own (bench/scale.py ``--replicas``). Every
    2 s it writes ``stats-<index>.json``: its CPU time, RSS, consumer lag and the results
    it took, and at the end the episodes it took results of (no episode may be in two)."""
    from services.dispatcher import rewards

    async def main() -> None:
        logging.disable(logging.WARNING)
        settings = Settings(
            db=DatabaseSettings(url=url, pool_size=pool_size),
            bus=BusSettings(kind=BusKind.kafka, bootstrap=bootstrap, partitions=partitions),
            storage=StorageSettings(kind=StorageKind.local, root=Path(data_dir) / "objects"),
            data_dir=Path(data_dir),
        )
        runtime = Runtime(settings, service=f"bench-dispatcher-{index}")
        await runtime.start()
        dispatcher = Dispatcher(runtime, settings=DispatcherSettings(**dispatcher_settings))
        await dispatcher.start()
        machine = dispatcher.machine
        assert machine is not None
        episodes: set[str] = set()
        taken = [0]
        on_results, on_rewards = machine.on_results, rewards.on_rewards

        async def counted_results(messages):  # type: ignore[no-untyped-def]
            ignored = machine.ignored
            await on_results(messages)
            taken[0] += len(messages) - (machine.ignored - ignored)
            episodes.update(m.episode_id for m in messages)

        async def counted_rewards(m, messages):  # type: ignore[no-untyped-def]
            ignored = machine.ignored
            await on_rewards(m, messages)
            taken[0] += len(messages) - (machine.ignored - ignored)
            episodes.update(message.episode_id for message in messages)

        machine.on_results = counted_results  # type: ignore[method-assign]
        rewards.on_rewards = counted_rewards

        def write(final: bool = False) -> None:
            lag = sum(
                s.value
                for family in metrics.BUS_CONSUMER_LAG.collect()
                for s in family.samples
                if s.labels.get("group") == dispatcher_settings["results_group"]
            )
            stats = {
                "cpu_s": time.process_time(),
                "rss_mb": _rss_mb(os.getpid()),
                "lag": lag,
                "taken": taken[0],
                "ignored": machine.ignored,
                "episodes": len(episodes),
            }
            if final:
                stats["episode_ids"] = sorted(episodes)
            path = Path(stats_dir) / f"stats-{index}.json"
            path.with_suffix(".tmp").write_text(json.dumps(stats))
            path.with_suffix(".tmp").replace(path)

        write()
        ready.set()
        while not await asyncio.to_thread(stop.wait, 2.0):
            write()
        await dispatcher.stop()
        write(final=True)
        await runtime.stop()

    run_loop(main())


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def replica_stats(bench: Bench) -> list[dict]:
    """The replicas' latest stats files."""
    if bench.stats_dir is None:
        return []
    return [json.loads(p.read_text()) for p in sorted(bench.stats_dir.glob("stats-*.json"))]


async def kafka_roundtrip(runtime: Runtime, n: int, suffix: str) -> list[float]:
    """Produce → consume on a fresh topic, one message at a time (ms)."""
    bus = runtime.bus
    topic = f"bench.ping.{suffix}"
    await bus.create_topics([topic], partitions=1)
    got: asyncio.Queue[float] = asyncio.Queue()

    async def on(record: Record) -> None:
        got.put_nowait(time.perf_counter())

    consumer = await bus.subscribe([topic], f"bench-ping-{suffix}", on)
    await bus.send(topic, b"warm", key="k")
    await asyncio.wait_for(got.get(), 60)  # the group has joined
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await bus.send(topic, b"ping", key="k")
        t1 = await asyncio.wait_for(got.get(), 10)
        samples.append((t1 - t0) * 1000)
    await consumer.stop()
    return samples


def spec(episodes: int, concurrency: int, max_turns: int) -> dict:
    return JobSpec.model_validate(
        {
            "name": "bench-dispatch",
            "policy": {"model": "stub", "sampling": {"max_tokens": 16}},
            "tasks": {"taskset": "bench", "group_size": 1},
            "environment": {"kind": "code", "max_turns": max_turns},
            "schedule": {
                "iterations": 1,
                "episodes_per_iteration": episodes,
                "max_concurrent_episodes": concurrency,
                "max_staleness": 100,
            },
        }
    ).model_dump(mode="json")


async def run_job(
    db, job_id: str, episodes: int, concurrency: int, max_turns: int, machine: MachineCpu | None = None
) -> dict:
    async with db.session() as s:
        s.add(
            Job(
                id=job_id,
                tenant_id="bench",
                name="bench",
                spec=spec(episodes, concurrency, max_turns),
                state="pending",
            )
        )
    t0 = time.perf_counter()
    submitted = utcnow()
    cpu0 = time.process_time()
    machine0 = await machine.sample() if machine is not None else {}
    # Polled 4 times a second: the poll runs in the dispatcher's process, and its CPU is
    # counted as the dispatcher's (20 polls a second were 0.3 ms of every turn); the job's
    # wall time comes from its steps, not from when a poll saw it end.
    while True:
        async with db.session() as s:
            state = await s.scalar(select(Job.state).where(Job.id == job_id))
        if state in ("completed", "failed", "cancelled"):
            break
        if time.perf_counter() - t0 > 300:
            raise TimeoutError(f"job {job_id} did not finish in 300 s")
        await asyncio.sleep(0.25)
    cpu = time.process_time() - cpu0
    parts = MachineCpu.used(machine0, await machine.sample()) if machine is not None else {}
    async with db.session() as s:
        scored = await s.scalar(
            select(func.count())
            .select_from(Episode)
            .where(Episode.job_id == job_id, Episode.state == "scored")
        )
        # A turn is the time between the dispatcher issuing one inference request of an
        # episode and issuing the next (the step rows are written as the requests are).
        issued = (
            await s.execute(
                select(Step.episode_id, Step.turn, Step.created_at)
                .join(Episode, Episode.id == Step.episode_id)
                .where(Episode.job_id == job_id, Step.kind == "inference")
                .order_by(Step.episode_id, Step.turn)
            )
        ).all()
        last = await s.scalar(
            select(func.max(Step.completed_at))
            .join(Episode, Episode.id == Step.episode_id)
            .where(Episode.job_id == job_id)
        )
        parts_of_turn = await turn_parts(s, job_id)
    wall = (last - submitted).total_seconds() if last is not None else time.perf_counter() - t0
    gaps = [
        (b.created_at - a.created_at).total_seconds() * 1000
        for a, b in zip(issued, issued[1:], strict=False)
        if a.episode_id == b.episode_id
    ]
    return {
        "state": state,
        "wall_s": wall,
        "cpu_s": cpu,
        "scored": scored,
        "gaps_ms": gaps,
        "turns": scored * max_turns,
        "parts_cpu_s": parts,
        "turn_parts_ms": parts_of_turn,
    }


async def turn_parts(s, job_id: str) -> dict[str, list[float]]:  # noqa: ANN001 - a session
    """Where a turn's wall time goes, from its step rows (one clock: the peers run on this
    machine): ``to_policy`` from writing the inference step to the policy's answer (commit,
    publish, a Kafka hop, the stub), ``from_policy`` from that answer to the dispatcher
    recording it (a hop, the consumer, the batch's transaction), ``sandbox`` the sandbox
    step's whole round, ``to_next`` from the sandbox step's end to the next inference step."""
    found = (
        await s.execute(
            select(Step.episode_id, Step.turn, Step.kind, Step.created_at, Step.completed_at, Step.result)
            .join(Episode, Episode.id == Step.episode_id)
            .where(Episode.job_id == job_id, Step.kind.in_(("inference", "sandbox")))
        )
    ).all()
    steps = {(r.episode_id, r.turn, r.kind): r for r in found}
    out: dict[str, list[float]] = {"to_policy": [], "from_policy": [], "sandbox": [], "to_next": []}
    for (episode, turn, kind), inf in steps.items():
        sandbox = steps.get((episode, turn, "sandbox"))
        following = steps.get((episode, turn + 1, "inference"))
        if kind != "inference" or sandbox is None or following is None or inf.completed_at is None:
            continue
        answered = datetime.fromisoformat((inf.result or {})["answered_at"])
        out["to_policy"].append(_ms(inf.created_at, answered))
        out["from_policy"].append(_ms(answered, inf.completed_at))
        out["sandbox"].append(_ms(sandbox.created_at, sandbox.completed_at))
        out["to_next"].append(_ms(sandbox.completed_at, following.created_at))
    return out


def _ms(start: datetime, end: datetime) -> float:
    return (end - start).total_seconds() * 1000


@dataclass
class Bench:
    """What :func:`bench_stack` started: the runtime and (without replicas) the dispatcher
    in this process, the stub peers in another and (with replicas) each dispatcher replica
    in its own, on a fresh database and the shared Kafka."""

    runtime: Runtime
    dispatcher: Dispatcher | None
    peers: multiprocessing.process.BaseProcess
    prefix: str  # every job id starts with it (the peers answer only those)
    suffix: str
    database: str
    admin_url: str
    results_group: str
    replicas: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    stats_dir: Path | None = None  # each replica's stats-<n>.json (replica_stats)


@contextlib.asynccontextmanager
async def bench_stack(
    name: str,
    *,
    partitions: int,
    max_turns: int,
    policy_delay_s: tuple[float, float] = (0.0, 0.0),
    lease_s: float = 120,
    scheduler_interval_s: float = 0.02,  # the latency bench's; the service's default is 0.5
    replicas: int = 0,
    replica_pool_size: int = 10,
    fleet_max_episodes: int | None = None,
) -> AsyncIterator[Bench]:
    """``replicas`` 0: one dispatcher in this process; N: N dispatcher processes in one
    consumer group (each with a pool of ``replica_pool_size`` connections)."""
    suffix = uuid.uuid4().hex[:8]
    base = os.environ.get("TEMPER_DB__URL", "postgresql+asyncpg://temper:temper@127.0.0.1:55432/temper")
    bootstrap = os.environ.get("TEMPER_BUS__BOOTSTRAP", "127.0.0.1:59092")
    admin = base.replace("postgresql+asyncpg://", "postgresql://")
    dbname = f"bench_{name}_{suffix}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{dbname}"')
    await conn.close()
    url = base.rsplit("/", 1)[0] + f"/{dbname}"
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    try:
        await asyncio.to_thread(upgrade, url)
        settings = Settings(
            db=DatabaseSettings(url=url, pool_size=20),
            bus=BusSettings(kind=BusKind.kafka, bootstrap=bootstrap, partitions=partitions),
            storage=StorageSettings(kind=StorageKind.local, root=tmp / "objects"),
            data_dir=tmp,
        )
        runtime = Runtime(settings, service=f"bench-{name}")
        await runtime.start()
        logging.disable(logging.WARNING)
        async with runtime.db.session() as s:
            s.add(Tenant(id="bench", name="bench", max_concurrent_episodes=100_000))
        async with runtime.db.session() as s:
            s.add(TaskSet(id="bench", tenant_id="bench", name="bench", status="valid", task_count=1))
        async with runtime.db.session() as s:
            s.add(
                Task(
                    id="bench-t",
                    task_set_id="bench",
                    key="t",
                    kind="code",
                    prompt="Do nothing.",
                    spec={},
                    meta={},
                )
            )
        prefix = f"bench-{suffix}-"
        results_group = f"bench-dispatcher-{suffix}"
        # New consumer groups would start at the earliest offset and replay what earlier runs
        # left in the shared topics: start them at the end instead.
        requests = (Topics.INFERENCE_REQUESTS, Topics.SANDBOX_REQUESTS, Topics.REWARD_REQUESTS)
        await start_groups_at_end(
            bootstrap,
            {
                **{f"bench-{t}-{suffix}": [t] for t in requests},
                results_group: [Topics.INFERENCE_RESULTS, Topics.SANDBOX_RESULTS, Topics.REWARD_RESULTS],
                f"bench-dispatcher-policy-{suffix}": [Topics.POLICY_UPDATES],
            },
        )
        spawn = multiprocessing.get_context("spawn")
        peers_ready, peers_stop = spawn.Event(), spawn.Event()
        peers = spawn.Process(
            target=run_peers,
            args=(bootstrap, partitions, max_turns, prefix, suffix, peers_ready, peers_stop, policy_delay_s),
            daemon=True,
        )
        peers.start()
        if not await asyncio.to_thread(peers_ready.wait, 120):
            raise TimeoutError("the stub peers did not start")
        dispatcher_settings = dict(
            trainer_attached=False,
            scheduler_interval_s=scheduler_interval_s,
            lease_s=lease_s,
            result_concurrency=16 if not replicas else min(16, replica_pool_size - 2),  # under the pool size
            results_group=results_group,
            policy_group=f"bench-dispatcher-policy-{suffix}",
            fleet_max_episodes=fleet_max_episodes,
        )
        dispatcher: Dispatcher | None = None
        processes: list[multiprocessing.process.BaseProcess] = []
        stats_dir = tmp / "replicas" if replicas else None
        replica_stop = spawn.Event()
        if replicas:
            assert stats_dir is not None
            stats_dir.mkdir()
            readies = []
            for n in range(replicas):
                ready = spawn.Event()
                readies.append(ready)
                proc = spawn.Process(
                    target=run_replica,
                    args=(n, url, bootstrap, partitions, replica_pool_size, str(tmp), dispatcher_settings,
                          str(stats_dir), ready, replica_stop),
                    daemon=True,
                )  # fmt: skip
                proc.start()
                processes.append(proc)
            for ready in readies:
                if not await asyncio.to_thread(ready.wait, 180):
                    raise TimeoutError("a dispatcher replica did not start")
        else:
            dispatcher = Dispatcher(runtime, settings=DispatcherSettings(**dispatcher_settings))
            await dispatcher.start()
        yield Bench(
            runtime, dispatcher, peers, prefix, suffix, dbname, admin, results_group, processes, stats_dir
        )
        if dispatcher is not None:
            await dispatcher.stop()
        replica_stop.set()
        for proc in processes:
            await asyncio.to_thread(proc.join, 60)
        peers_stop.set()
        await asyncio.to_thread(peers.join, 30)
        await runtime.stop()
    finally:
        await drop_database(admin, dbname)


async def drop_database(admin: str, dbname: str, tries: int = 30) -> None:
    """Drop the bench's database. Right after a heavy run an autovacuum worker (the
    superuser's) may be on it, which FORCE may not terminate: wait for it to finish."""
    conn = await asyncpg.connect(admin)
    try:
        for attempt in range(tries):
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
                return
            except (asyncpg.InsufficientPrivilegeError, asyncpg.ObjectInUseError):
                if attempt == tries - 1:
                    print(f"warning: could not drop database {dbname}; drop it by hand", file=sys.stderr)
                    return
                await asyncio.sleep(2)
    finally:
        await conn.close()


async def measure(args: argparse.Namespace) -> dict:
    """One measurement of the code this process imported (``BENCH_CODE``)."""
    logging.disable(logging.WARNING)
    async with bench_stack(
        "dispatch",
        partitions=args.partitions,
        max_turns=args.turns,
        scheduler_interval_s=args.scheduler_interval_s,
    ) as bench:
        runtime, prefix, suffix = bench.runtime, bench.prefix, bench.suffix
        machine = MachineCpu(bench.admin_url, bench.database, bench.peers.pid)
        ping = await kafka_roundtrip(runtime, args.pings, suffix)
        # Warm-up (consumer groups join, caches fill), then a latency run with few episodes
        # in flight, then a throughput run with many.
        await run_job(runtime.db, f"{prefix}warm", 4, 4, 2)
        latency = await run_job(runtime.db, f"{prefix}lat", args.latency_episodes, 4, args.turns)
        statements: Counter[str] = Counter()
        if args.count_statements:

            def count(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
                statements[" ".join(statement.split())[:90]] += 1

            sqlalchemy.event.listen(runtime.db.engine.sync_engine, "before_cursor_execute", count)
        profiler = cProfile.Profile(time.process_time) if args.profile else None  # CPU, not waits
        if profiler is not None:
            profiler.enable()
        sampler = StackSampler() if args.sample else None
        if sampler is not None:
            sampler.start()
        throughput = await run_job(
            runtime.db, f"{prefix}tput", args.episodes, args.concurrency, args.turns, machine
        )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        if sampler is not None:
            sampler.stop()
            sampler.dump(args.sample)
        if args.count_statements:
            sqlalchemy.event.remove(runtime.db.engine.sync_engine, "before_cursor_execute", count)
            counted = json.dumps(
                {"turns": throughput["turns"], "statements": statements.most_common()}, indent=1
            )
            await asyncio.to_thread(Path(args.count_statements).write_text, counted)
        ping_after = await kafka_roundtrip(runtime, args.pings, suffix + "b")
    pings = ping + ping_after
    gaps = latency["gaps_ms"]
    parts_of_turn = {
        f"turn_{name}_p50_ms": round(pct(values, 0.5), 2) for name, values in latency["turn_parts_ms"].items()
    }
    turns = max(1, throughput["turns"])
    parts = throughput["parts_cpu_s"]
    return {
        "turn_overhead_p50_ms": round(pct(gaps, 0.5), 2),
        "turn_overhead_p99_ms": round(pct(gaps, 0.99), 2),
        "turn_overhead_mean_ms": round(statistics.fmean(gaps), 2) if gaps else None,
        "turns_per_s": round(throughput["turns"] / throughput["wall_s"], 1),
        "kafka_roundtrip_p50_ms": round(pct(pings, 0.5), 2),
        "kafka_roundtrip_p99_ms": round(pct(pings, 0.99), 2),
        "kafka_hops_per_turn": 4,
        "under_load_turn_p50_ms": round(pct(throughput["gaps_ms"], 0.5), 2),
        "under_load_turn_p99_ms": round(pct(throughput["gaps_ms"], 0.99), 2),
        "latency_episodes": latency["scored"],
        "throughput_episodes": throughput["scored"],
        "throughput_concurrency": args.concurrency,
        "turns_per_episode": args.turns,
        "throughput_wall_s": round(throughput["wall_s"], 2),
        "dispatcher_cpu_ms_per_turn": round(throughput["cpu_s"] * 1000 / turns, 2),
        "machine_cpu_ms_per_turn": round(sum(parts.values()) * 1000 / turns, 2),
        "postgres_cpu_ms_per_turn": round(parts["postgres"] * 1000 / turns, 2),
        "kafka_cpu_ms_per_turn": round(parts["kafka"] * 1000 / turns, 2),
        "peers_cpu_ms_per_turn": round(parts["peers"] * 1000 / turns, 2),
        "partitions": args.partitions,
        "scheduler_interval_s": args.scheduler_interval_s,
        **parts_of_turn,
    }


SIDE_KEYS = (
    "turn_overhead_p50_ms",
    "turn_overhead_p99_ms",
    "turns_per_s",
    "under_load_turn_p50_ms",
    "under_load_turn_p99_ms",
    "kafka_roundtrip_p50_ms",
    "dispatcher_cpu_ms_per_turn",
    "machine_cpu_ms_per_turn",
    "postgres_cpu_ms_per_turn",
    "kafka_cpu_ms_per_turn",
    "peers_cpu_ms_per_turn",
)


def baseline_checkout(commit: str) -> Path:
    """The baseline's files (``git archive`` of ``commit``), unpacked once per commit."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    target = Path(tempfile.gettempdir()) / f"temper-bench-baseline-{sha[:12]}"
    if not (target / "libs").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", sha, "libs", "services", "migrations", "alembic.ini"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def one_run(code: Path, args: argparse.Namespace, interval_s: float) -> dict:
    """One measurement in a fresh process that imports the code in ``code``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--single", "--out", str(path),
        "--turns", str(args.turns), "--latency-episodes", str(args.latency_episodes),
        "--episodes", str(args.episodes), "--concurrency", str(args.concurrency),
        "--partitions", str(args.partitions), "--pings", str(args.pings),
        "--scheduler-interval-s", str(interval_s),
    ]  # fmt: skip
    load_before = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env={**os.environ, "BENCH_CODE": str(code)})
    result = json.loads(path.read_text())
    path.unlink()
    result["load_avg_1m_before"] = round(load_before, 2)
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def compare(args: argparse.Namespace) -> dict:
    """``--rounds`` x (baseline, then this checkout), each in its own process; medians."""
    runs: dict[str, list[dict]] = {"baseline": [], "now": []}
    base = baseline_checkout(args.baseline) if args.baseline != "none" else None
    for n in range(args.rounds):
        if base is not None:
            print(f"round {n + 1}: baseline {args.baseline}", flush=True)  # noqa: T201
            runs["baseline"].append(one_run(base, args, args.baseline_scheduler_interval_s))
        print(f"round {n + 1}: this checkout", flush=True)  # noqa: T201
        runs["now"].append(one_run(ROOT, args, args.scheduler_interval_s))
    result = dict(runs["now"][-1])
    for key in SIDE_KEYS:
        result[key] = round(statistics.median(r[key] for r in runs["now"]), 2)
        result[f"rounds_{key}"] = ", ".join(str(r[key]) for r in runs["now"])
        if runs["baseline"]:
            result[f"baseline_{key}"] = round(statistics.median(r[key] for r in runs["baseline"]), 2)
            result[f"baseline_rounds_{key}"] = ", ".join(str(r[key]) for r in runs["baseline"])
    loads = [
        v for side in runs.values() for r in side for v in (r["load_avg_1m_before"], r["load_avg_1m_after"])
    ]
    result.update(
        rounds=args.rounds,
        baseline=args.baseline,
        baseline_scheduler_interval_s=args.baseline_scheduler_interval_s if base else None,
        load_avg_1m_min=min(loads),
        load_avg_1m_max=max(loads),
        rounds_load_avg_1m=", ".join(
            f"{r['load_avg_1m_before']}-{r['load_avg_1m_after']}" for r in runs["now"]
        ),
        baseline_rounds_load_avg_1m=", ".join(
            f"{r['load_avg_1m_before']}-{r['load_avg_1m_after']}" for r in runs["baseline"]
        ),
        cpus=os.cpu_count(),
        target_turn_overhead_p50_ms=15,
        target_turns_per_s=200,
        target_dispatcher_cpu_ms_per_turn=2,
    )
    result.pop("load_avg_1m_before", None)
    result.pop("load_avg_1m_after", None)
    return result


def table(result: dict) -> str:
    def both(key: str) -> str:
        base = result.get(f"baseline_{key}")
        return f"{base} -> {result[key]}" if base is not None else str(result[key])

    rows = [
        ("turn overhead p50 (ms)", both("turn_overhead_p50_ms"), "<= 15"),
        ("turn overhead p99 (ms)", both("turn_overhead_p99_ms"), ""),
        ("turns per second", both("turns_per_s"), ">= 200"),
        (
            "kafka produce->consume p50 (ms)",
            both("kafka_roundtrip_p50_ms"),
            f"x{result['kafka_hops_per_turn']} hops/turn",
        ),
        (
            f"turn p50 under load, {result['throughput_concurrency']} in flight (ms)",
            both("under_load_turn_p50_ms"),
            "",
        ),
        (
            f"turn p99 under load, {result['throughput_concurrency']} in flight (ms)",
            both("under_load_turn_p99_ms"),
            "",
        ),
        ("dispatcher CPU per turn (ms)", both("dispatcher_cpu_ms_per_turn"), "<= 2"),
        ("machine CPU per turn (ms)", both("machine_cpu_ms_per_turn"), "must not rise"),
        ("  of it Postgres (ms)", both("postgres_cpu_ms_per_turn"), ""),
        ("  of it Kafka (ms)", both("kafka_cpu_ms_per_turn"), ""),
        ("  of it the peers (ms)", both("peers_cpu_ms_per_turn"), ""),
        (
            "load average (1 min) over the runs",
            f"{result.get('load_avg_1m_min')}-{result.get('load_avg_1m_max')}",
            f"{result.get('cpus')} cores",
        ),
    ]
    note = (
        f"baseline {result['baseline']} -> this checkout"
        if result.get("baseline") not in (None, "none")
        else ""
    )
    return metric_table(rows, f"target   ({note})", value_width=24)


def metric_table(rows: list[tuple[str, object, str]], note: str, value_width: int = 10) -> str:
    """Rows of (metric, value, note) as a plain-text table (bench/scale.py uses it too)."""
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'metric'.ljust(width)}  {'value':>{value_width}}  {note}", "-" * (width + value_width + 16)]
    lines += [f"{name.ljust(width)}  {value!s:>{value_width}}  {text}" for name, value, text in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="dispatcher orchestration overhead per turn")
    parser.add_argument("--turns", type=int, default=4, help="turns per episode")
    parser.add_argument("--latency-episodes", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=256, help="episodes in the throughput run")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="episodes in flight in the throughput run"
    )
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--pings", type=int, default=200)
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="baseline/this-checkout pairs (4: this machine's speed moves between rounds; a median of 2 is their mean)",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE,
        help="the git commit measured against, or 'none' (default: main before the hot path went on the driver)",
    )
    parser.add_argument(
        "--scheduler-interval-s",
        type=float,
        default=0.5,
        help="this checkout's fallback tick (the service default; it is woken by finished episodes)",
    )
    parser.add_argument(
        "--baseline-scheduler-interval-s",
        type=float,
        default=0.5,
        help="the baseline's tick (0.02 for a baseline before the scheduler was woken by work, f43815c)",
    )
    parser.add_argument(
        "--profile", default="", help="with --single: cProfile the throughput run into this file"
    )
    parser.add_argument(
        "--sample",
        default="",
        help="with --single: a sampling profile of the throughput run (the stack every ms of CPU) to this file",
    )
    parser.add_argument(
        "--count-statements",
        default="",
        help="with --single: the throughput run's SQL statements, counted, to this file",
    )
    parser.add_argument(
        "--single", action="store_true", help="one measurement of BENCH_CODE (or this checkout)"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "dispatch.json"))
    args = parser.parse_args()
    result = run_loop(measure(args)) if args.single else compare(args)
    if not args.single:
        print(table(result))  # noqa: T201
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if not args.single:
        print(f"wrote {args.out}")  # noqa: T201
