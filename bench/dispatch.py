"""Dispatcher orchestration overhead per turn, over the real stack (Kafka + Postgres).

Bench-local doubles of the peers answer at once: a stub policy (a ``true`` shell
command until the last turn, then ``submit``), a no-op sandbox and a constant reward.
They run in a process of their own, as the real services do. So a turn's wall time is
all orchestration: two Kafka round trips (inference, sandbox) and two Postgres
transactions that record a result and write the next command, published as they commit.
A turn is measured from the step rows: the time between the dispatcher issuing one
inference request of an episode and issuing the next. Measured next to the raw Kafka
produce→consume hop of the same run; the dispatcher process's CPU time per turn is
reported too.

    python bench/dispatch.py            # make bench-dispatch
    python bench/dispatch.py --episodes 512 --concurrency 128

Writes bench/results/dispatch.json (flat JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

import asyncpg  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from services.dispatcher.component import Dispatcher  # noqa: E402
from temper.bus import Record  # noqa: E402
from temper.bus.kafka import KafkaBus, start_groups_at_end  # noqa: E402
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
RUN_TEXT = "```bash\ntrue\n```"
SUBMIT_TEXT = "submit"


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

    asyncio.run(main())


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


async def run_job(db, job_id: str, episodes: int, concurrency: int, max_turns: int) -> dict:
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
    cpu0 = time.process_time()
    while True:
        async with db.session() as s:
            state = await s.scalar(select(Job.state).where(Job.id == job_id))
        if state in ("completed", "failed", "cancelled"):
            break
        if time.perf_counter() - t0 > 300:
            raise TimeoutError(f"job {job_id} did not finish in 300 s")
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
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
    }


@dataclass
class Bench:
    """What :func:`bench_stack` started: the runtime and dispatcher in this process, the
    stub peers in another, on a fresh database and the shared Kafka."""

    runtime: Runtime
    dispatcher: Dispatcher
    peers: multiprocessing.process.BaseProcess
    prefix: str  # every job id starts with it (the peers answer only those)
    suffix: str
    database: str
    admin_url: str
    results_group: str


@contextlib.asynccontextmanager
async def bench_stack(
    name: str,
    *,
    partitions: int,
    max_turns: int,
    policy_delay_s: tuple[float, float] = (0.0, 0.0),
    lease_s: float = 120,
    scheduler_interval_s: float = 0.02,  # the latency bench's; the service's default is 0.5
) -> AsyncIterator[Bench]:
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
        dispatcher = Dispatcher(
            runtime,
            settings=DispatcherSettings(
                trainer_attached=False,
                scheduler_interval_s=scheduler_interval_s,
                lease_s=lease_s,
                result_concurrency=16,  # under the pool size (20)
                results_group=results_group,
                policy_group=f"bench-dispatcher-policy-{suffix}",
            ),
        )
        await dispatcher.start()
        yield Bench(runtime, dispatcher, peers, prefix, suffix, dbname, admin, results_group)
        await dispatcher.stop()
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


async def main(args: argparse.Namespace) -> dict:
    logging.disable(logging.WARNING)
    async with bench_stack("dispatch", partitions=args.partitions, max_turns=args.turns) as bench:
        runtime, prefix, suffix = bench.runtime, bench.prefix, bench.suffix
        ping = await kafka_roundtrip(runtime, args.pings, suffix)
        # Warm-up (consumer groups join, caches fill), then a latency run with few episodes
        # in flight, then a throughput run with many.
        await run_job(runtime.db, f"{prefix}warm", 4, 4, 2)
        latency = await run_job(runtime.db, f"{prefix}lat", args.latency_episodes, 4, args.turns)
        throughput = await run_job(runtime.db, f"{prefix}tput", args.episodes, args.concurrency, args.turns)
        ping_after = await kafka_roundtrip(runtime, args.pings, suffix + "b")
    pings = ping + ping_after
    gaps = latency["gaps_ms"]
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
        "dispatcher_cpu_ms_per_turn": round(throughput["cpu_s"] * 1000 / max(1, throughput["turns"]), 2),
        "partitions": args.partitions,
        "target_turn_overhead_p50_ms": 15,
        "target_turns_per_s": 200,
    }


def table(result: dict) -> str:
    rows = [
        ("turn overhead p50 (ms)", result["turn_overhead_p50_ms"], "<= 15"),
        ("turn overhead p99 (ms)", result["turn_overhead_p99_ms"], ""),
        ("turns per second", result["turns_per_s"], ">= 200"),
        (
            "kafka produce->consume p50 (ms)",
            result["kafka_roundtrip_p50_ms"],
            f"x{result['kafka_hops_per_turn']} hops/turn",
        ),
        ("kafka produce->consume p99 (ms)", result["kafka_roundtrip_p99_ms"], ""),
        (
            f"turn p50 under load, {result['throughput_concurrency']} in flight (ms)",
            result["under_load_turn_p50_ms"],
            "",
        ),
        (
            f"turn p99 under load, {result['throughput_concurrency']} in flight (ms)",
            result["under_load_turn_p99_ms"],
            "",
        ),
        (
            "dispatcher CPU per turn (ms)",
            result["dispatcher_cpu_ms_per_turn"],
            "one core: 1000/this turns/s at most",
        ),
    ]
    return metric_table(rows, "target")


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
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "dispatch.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
