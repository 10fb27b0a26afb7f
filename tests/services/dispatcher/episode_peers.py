"""Test doubles of the dispatcher's peers (gateway, sandbox worker, reward scorer) and
a harness that runs a Dispatcher on a Runtime. Used by the machine tests on the
in-process bus and by the integration tests on real Kafka and Postgres."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from services.dispatcher.component import Dispatcher
from temper.bus import Consumer
from temper.bus.kafka import start_groups_at_end
from temper.db import Database, Episode, Job, Step, Task, TaskSet, Tenant
from temper.db.migrate import upgrade
from temper.events import (
    InferenceRequest,
    InferenceResult,
    Message,
    RewardComponent,
    RewardRequest,
    RewardResult,
    SandboxRequest,
    SandboxResult,
    Topics,
    decode,
)
from temper.jobspec import JobSpec
from temper.policy.tokenizer import default_tokenizer
from temper.runtime import Runtime
from temper.settings import (
    AgentSettings,
    BusKind,
    BusSettings,
    DatabaseSettings,
    DispatcherSettings,
    Settings,
    StorageKind,
    StorageSettings,
)
from temper.tasks.service import record_outcome

TOK = default_tokenizer()
FENCE = "```"
Script = Callable[[InferenceRequest], str | None]  # None: don't answer (yet)


def settings_for(
    tmp: Path, db_url: str, *, bootstrap: str | None = None, partitions: int = 4, agent_url: str | None = None
) -> Settings:
    bus = (
        BusSettings(kind=BusKind.kafka, bootstrap=bootstrap, partitions=partitions)
        if bootstrap
        else BusSettings(kind=BusKind.inprocess, partitions=partitions, retry_backoff_s=0.01)
    )
    return Settings(
        db=DatabaseSettings(url=db_url),
        bus=bus,
        storage=StorageSettings(kind=StorageKind.local, root=tmp / "objects"),
        data_dir=tmp,
        agent=AgentSettings(url=agent_url),
    )


def engine_settings(**kw: Any) -> DispatcherSettings:
    base = dict(
        lease_s=10.0,
        max_step_attempts=3,
        trainer_attached=False,
        scheduler_interval_s=0.05,
        reaper_interval_s=0.1,
    )
    base.update(kw)
    return DispatcherSettings(**base)


def job_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "test-job",
        "policy": {"model": "tiny", "sampling": {"max_tokens": 64}},
        "tasks": {"taskset": "ts1", "group_size": 2, "curriculum": "learnable"},
        "environment": {"kind": "code", "max_turns": 3},
        "rewards": {"tests_passed": 1.0},
        "algorithm": {"groups_per_step": 1},
        "schedule": {
            "iterations": 1,
            "episodes_per_iteration": 4,
            "max_concurrent_episodes": 16,
            "max_staleness": 1,
        },
    }
    for path, value in over.items():
        node = spec
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return JobSpec.model_validate(spec).model_dump(mode="json")


async def seed(
    db: Database,
    *,
    tasks: dict[str, dict[str, Any]] | None = None,
    quota: int = 64,
    tenant: str = "acme",
    taskset: str = "ts1",
) -> str | None:
    """Tenant, task set and tasks; past outcomes as a finished job left them (its id is
    returned, for ``tasks.prior_from_job``)."""
    tasks = tasks if tasks is not None else {"t1": {}, "t2": {}}
    async with db.session() as s:
        if await s.get(Tenant, tenant) is None:
            s.add(Tenant(id=tenant, name=tenant, max_concurrent_episodes=quota))
        if await s.get(TaskSet, taskset) is None:
            s.add(TaskSet(id=taskset, tenant_id=tenant, name=taskset, status="valid", task_count=len(tasks)))
    async with db.session() as s:
        for tid, extra in tasks.items():
            s.add(
                Task(
                    id=tid,
                    task_set_id=taskset,
                    key=tid,
                    kind=extra.get("kind", "code"),
                    prompt=extra.get("prompt", f"Solve {tid}."),
                    spec=extra.get("spec", {"files": {"add.py": "def add(a, b):\n    return a - b\n"}}),
                    meta={},
                    status=extra.get("status", "valid"),
                    split=extra.get("split", "train"),
                )
            )
    history = {tid: extra for tid, extra in tasks.items() if extra.get("attempts")}
    if history:  # past outcomes, as a finished job of the same tenant left them
        async with db.session() as s:
            past = f"history-{uuid.uuid4().hex[:8]}"
            s.add(Job(id=past, tenant_id=tenant, name="history", spec={"tasks": {"taskset": taskset}},
                      state="completed"))  # fmt: skip
            await s.flush()
            for tid, extra in history.items():
                for i in range(extra["attempts"]):
                    s.add(Episode(id=f"{past}-{tid}-{i}", job_id=past, tenant_id=tenant, task_id=tid,
                                  group_id="g", state="trained"))  # fmt: skip
                    await s.flush()
                    ok = i < extra.get("passes", 0)
                    record_outcome(s, episode_id=f"{past}-{tid}-{i}", task_id=tid, job_id=past,
                                   policy_version=0, passed=ok, reward=float(ok))  # fmt: skip
        return past
    return None


async def submit_job(
    db: Database, spec: dict[str, Any], *, tenant: str = "acme", job_id: str | None = None
) -> str:
    job_id = job_id or f"job-{uuid.uuid4().hex[:8]}"
    async with db.session() as s:
        s.add(Job(id=job_id, tenant_id=tenant, name=spec["name"], spec=spec, state="pending"))
    return job_id


def code_script(req: InferenceRequest) -> str:
    """Turn 0 looks around, turn 1 writes the fix and submits."""
    if req.turn == 0:
        return f"Let me look.\n{FENCE}bash\ncat add.py\n{FENCE}"
    return f"{FENCE}python add.py\ndef add(a, b):\n    return a + b\n{FENCE}\nsubmit"


@dataclass
class Peers:
    """Fake gateway, sandbox worker and reward scorer on the bus. ``script`` writes the
    model's text; ``duplicate`` answers everything twice; ``drop(kind, attempt)`` says
    whether to stay silent for a request."""

    runtime: Runtime
    script: Script = code_script
    duplicate: bool = False
    drop: Callable[[Message], bool] = lambda m: False
    # the version the fake gateway tags each answer with (a function: per request)
    policy_version: int | Callable[[InferenceRequest], int] = 0
    reward_fn: Callable[[RewardRequest], float] = lambda r: 1.0
    requests: dict[str, list[Message]] = field(default_factory=lambda: defaultdict(list))
    trajectories: list[Message] = field(default_factory=list)
    events: list[Message] = field(default_factory=list)
    held: list[Message] = field(default_factory=list)
    hold: bool = False
    job_prefix: str = ""  # on a shared Kafka, answer only this test's jobs
    delay_s: float = 0.0  # model "thinking" time per inference request
    # the version of each token of an answer (a partial rollout's span), else policy_version for all
    token_versions: Callable[[InferenceRequest, int], list[int]] | None = None
    # what each sandbox action reports beside its output (cpu_s, peak_memory_mb, wall_s:
    # what a tenant's quotas count)
    sandbox_reports: dict[str, float] = field(default_factory=dict)
    _consumers: list[Consumer] = field(default_factory=list)

    def groups(self, group_suffix: str) -> dict[str, list[str]]:
        topics = (Topics.INFERENCE_REQUESTS, Topics.SANDBOX_REQUESTS, Topics.REWARD_REQUESTS)
        out = {f"peer-{t}{group_suffix}": [t] for t in topics}
        out[f"peer-trainer{group_suffix}"] = [Topics.TRAJECTORIES]
        out[f"peer-analytics{group_suffix}"] = [Topics.EVENTS]
        return out

    async def start(self, group_suffix: str = "", bootstrap: str | None = None) -> None:
        rt = self.runtime
        assert rt.bus is not None
        if bootstrap:
            await start_groups_at_end(bootstrap, self.groups(group_suffix))
        for topic in (Topics.INFERENCE_REQUESTS, Topics.SANDBOX_REQUESTS, Topics.REWARD_REQUESTS):
            self._consumers.append(
                await rt.bus.subscribe(
                    [topic], f"peer-{topic}{group_suffix}", self._on_request, concurrency=4
                )
            )
        self._consumers.append(
            await rt.bus.subscribe(
                [Topics.TRAJECTORIES], f"peer-trainer{group_suffix}", self._collect(self.trajectories)
            )
        )
        self._consumers.append(
            await rt.bus.subscribe(
                [Topics.EVENTS], f"peer-analytics{group_suffix}", self._collect(self.events)
            )
        )

    def _collect(self, into: list[Message]) -> Callable[[Any], Awaitable[None]]:
        async def collect(record: Any) -> None:
            msg = decode(record.value)
            if (msg.job_id or "").startswith(self.job_prefix):
                into.append(msg)

        return collect

    async def stop(self) -> None:
        for c in self._consumers:
            await c.stop()

    async def _on_request(self, record: Any) -> None:
        msg = decode(record.value)
        if not (msg.job_id or "").startswith(self.job_prefix):
            return
        self.requests[msg.kind or "?"].append(msg)
        if self.drop(msg):
            return
        if self.hold and msg.kind == "inference":
            self.held.append(msg)
            return
        if self.delay_s and msg.kind == "inference":
            await asyncio.sleep(self.delay_s)
        await self.answer(msg)

    async def release(self) -> None:
        self.hold = False
        held, self.held = self.held, []
        for msg in held:
            await self.answer(msg)

    async def answer(self, msg: Message) -> None:
        reply = self.reply(msg)
        if reply is None:
            return
        assert self.runtime.bus is not None
        topic = {
            "inference": Topics.INFERENCE_RESULTS,
            "sandbox": Topics.SANDBOX_RESULTS,
            "reward": Topics.REWARD_RESULTS,
        }[msg.kind or ""]
        for _ in range(2 if self.duplicate else 1):
            await self.runtime.bus.send_message(topic, reply)

    def reply(self, msg: Message) -> Message | None:
        ids = dict(job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt)
        if isinstance(msg, InferenceRequest):
            text = self.script(msg)
            if text is None:
                return None
            tokens = [*TOK.encode(text), TOK.stop_ids[0]]
            versions = self.token_versions(msg, len(tokens)) if self.token_versions else []
            return InferenceResult(
                **ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                token_versions=versions,
                text=text,
                finish_reason="stop",
                policy_version=versions[-1]
                if versions
                else (self.policy_version(msg) if callable(self.policy_version) else self.policy_version),
                backend="fake",
            )
        if isinstance(msg, SandboxRequest):
            return SandboxResult(
                **ids,
                session_id=msg.session_id,
                result={
                    "exit_code": 0,
                    "stdout": f"ran {msg.action['kind']}",
                    "wall_s": 0.001,
                    **self.sandbox_reports,
                },
                snapshot_key=f"snapshots/{msg.session_id}/{msg.turn}.tar.gz",
                worker="fake-worker",
            )
        if isinstance(msg, RewardRequest):
            value = self.reward_fn(msg)
            return RewardResult(
                **ids,
                task_id=msg.task_id,
                reward=value,
                components={"tests_passed": RewardComponent(value=value)},
            )
        return None


@dataclass
class Harness:
    runtime: Runtime
    dispatcher: Dispatcher
    peers: Peers

    @property
    def db(self) -> Database:
        assert self.runtime.db is not None
        return self.runtime.db

    async def stop(self) -> None:
        await self.peers.stop()
        await self.dispatcher.stop()
        await self.runtime.stop()


async def start_harness(
    tmp: Path,
    db_url: str,
    *,
    bootstrap: str | None = None,
    migrate: bool = True,
    peers: dict[str, Any] | None = None,
    peers_class: type[Peers] | None = None,
    agent_url: str | None = None,
    **machine: Any,
) -> Harness:
    if migrate:
        await asyncio.to_thread(upgrade, db_url)
    runtime = Runtime(
        settings_for(tmp, db_url, bootstrap=bootstrap, agent_url=agent_url), service="dispatcher"
    )
    await runtime.start()
    if bootstrap:  # a shared broker: this test's own consumer groups
        suffix = uuid.uuid4().hex[:8]
        machine.setdefault("results_group", f"dispatcher-{suffix}")
        machine.setdefault("policy_group", f"dispatcher-policy-{suffix}")
    dispatcher = Dispatcher(runtime, settings=engine_settings(**machine))
    if bootstrap:
        await start_groups_at_end(
            bootstrap,
            {
                machine["results_group"]: [
                    Topics.INFERENCE_RESULTS,
                    Topics.SANDBOX_RESULTS,
                    Topics.REWARD_RESULTS,
                ],
                machine["policy_group"]: [Topics.POLICY_UPDATES],
            },
        )
    p = (peers_class or Peers)(runtime, **(peers or {}))
    await p.start(group_suffix=f"-{uuid.uuid4().hex[:6]}" if bootstrap else "", bootstrap=bootstrap)
    await dispatcher.start()
    return Harness(runtime, dispatcher, p)


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], limit_s: float = 20.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {limit_s}s waiting for {what}")


async def job_state(db: Database, job_id: str) -> str:
    async with db.session() as s:
        return (await s.scalar(select(Job.state).where(Job.id == job_id))) or "?"


async def episode_states(db: Database, job_id: str) -> Counter[str]:
    async with db.session() as s:
        rows = await s.execute(
            select(Episode.state, func.count()).where(Episode.job_id == job_id).group_by(Episode.state)
        )
        return Counter({state: n for state, n in rows})


async def steps_of(db: Database, episode_id: str) -> list[Step]:
    async with db.session() as s:
        return list(
            (
                await s.execute(
                    select(Step).where(Step.episode_id == episode_id).order_by(Step.turn, Step.id)
                )
            ).scalars()
        )


async def episodes_of(db: Database, job_id: str) -> list[Episode]:
    async with db.session() as s:
        return list(
            (
                await s.execute(select(Episode).where(Episode.job_id == job_id).order_by(Episode.created_at))
            ).scalars()
        )
