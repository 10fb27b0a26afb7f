"""``temper run SPEC``: one RL job, end to end, in one process.

Order of work: read the spec and its ``local:`` block; create the run directory with
its SQLite database and object store; store the task set; create the policy (and warm
it up if asked); start the five services on one runtime; submit the job; draw its
progress until it ends; write the report.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from transformers import AutoModelForCausalLM

from services.dispatcher.api.model_refs import reward_model_errors
from services.dispatcher.api.repo import create_job, job_metrics
from services.dispatcher.api.validation import check_template
from services.dispatcher.evaluation import section_errors
from services.embedded import agentrun, localrun
from services.embedded.components import components, in_one_process
from services.embedded.engine_process import EngineProcess
from services.embedded.report import write_report
from services.launcher.resources import free_port
from services.tracker.component import GROUP as TRACKER_GROUP
from services.trainer.training import JobTrainer
from temper import cores
from temper.bus.inprocess import InProcessBus
from temper.db import Database, Job, OutboxRow, PolicyVersion, Tenant
from temper.db.migrate import upgrade
from temper.envs import Environment, environment_options, make_environment
from temper.events import Topics
from temper.jobspec import AGENT_KIND, JobSpec, SpecError
from temper.lifecycle import JOB_TERMINAL, JobState
from temper.logs import get_logger, log_event
from temper.policy import (
    ChatTokenizer,
    byte_tokenizer,
    create_model,
    is_model_dir,
    load_model,
    save_checkpoint,
)
from temper.runtime import Runtime, StartupError, started
from temper.settings import (
    AgentSettings,
    BusSettings,
    DatabaseSettings,
    LogSettings,
    Mode,
    Settings,
    StorageSettings,
)
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings
from temper.tasks.models import parse_tasks
from temper.tasks.service import create_taskset
from temper.tasks.splits import SplitError
from temper.training.sft import turn_text, warm_start

log = get_logger("temper.run")
TENANT = "local"
POLICY_DIR = "policy-v0"


@dataclass
class RunResult:
    run_dir: Path
    job_id: str
    state: str
    summary: dict[str, Any]


def embedded_settings(
    run_dir: Path, spec: JobSpec, *, agent_url: str | None = None, engine_url: str | None = None
) -> Settings:
    """One process: SQLite, the in-process bus, a local object store, logs to a file (the
    terminal shows progress), and the gateway serving the run's policy from an
    in-process engine that batches a whole iteration's requests. A full-weight job with an
    ``evaluation`` gets a second engine: a version's full weights need an engine of their
    own, so its evaluations run beside the training instead of after it.

    torch's threads are the process's: the engine's decoding and the trainer's steps run
    at once (the next batch is generated while the last one trains). With all the cores
    each, two busy thread pools on one machine's cores slow both down several times, so
    :func:`run` shares them (``temper.cores``): each loop gets every core while it computes
    alone and half while both do. ``TEMPER_TRAINER__THREADS`` fixes the trainer's count
    instead (and the engine's: the threads it starts take the process's), as before the
    share; this function's default, half the cores, is what the share starts from.
    ``agent_url``: where the gateway's agent base URLs are served
    (``agentrun.serving_agents``). ``engine_url``: the policy's engine is the CPU model
    server there (``local.engine: process``, :mod:`services.embedded.engine_process`), not
    an in-process one."""
    batch = spec.schedule.max_concurrent_episodes
    if engine_url is None:
        policy = BackendSpec(
            name="local-0", kind=BackendKind.local, model_dir=str(run_dir / POLICY_DIR), max_batch=batch
        )
    else:
        policy = BackendSpec(name="local-0", kind=BackendKind.cpu_server, url=engine_url)
    backends = [policy]
    if spec.evaluation is not None and spec.algorithm.lora is None:
        evaluation_batch = spec.evaluation.max_concurrent_episodes or batch
        backends.append(
            BackendSpec(
                name="local-1",
                kind=BackendKind.local,
                model_dir=str(run_dir / POLICY_DIR),
                max_batch=evaluation_batch,
            )
        )
    # a judge with a model of its own gets an engine of its own, where the gateway loads it
    # (the policy's full weights hold theirs)
    judges = [
        s for name, s in spec.reward_settings().items() if name == "judge" and s.get("model") != "policy"
    ]
    backends += [
        BackendSpec(name=f"local-{len(backends) + i}", kind=BackendKind.local, max_batch=batch)
        for i in range(len(judges))
    ]
    settings = Settings(
        mode=Mode.embedded,
        service="temper-run",
        data_dir=run_dir,
        db=DatabaseSettings(url=f"sqlite+aiosqlite:///{run_dir / 'temper.db'}"),
        storage=StorageSettings(root=run_dir / "objects"),
        log=LogSettings(file=run_dir / "temper.log"),
        # More partitions than the default: each one is handled in order, so they bound
        # how many episodes' steps run at once.
        bus=BusSettings(partitions=max(6, batch)),
        inference=InferenceSettings(
            model_name=spec.policy.model,
            backends=backends,
            max_inflight_per_backend=batch,
            checkpoint_cache_dir=str(run_dir / "checkpoints"),
        ),
        agent=AgentSettings(url=agent_url),
    )
    threads = settings.trainer.threads or cores.half()
    settings = settings.model_copy(
        update={"trainer": settings.trainer.model_copy(update={"threads": threads})}
    )
    return in_one_process(settings, scheduler_interval_s=0.1, reaper_interval_s=0.5)


class Progress:
    """The live block on the terminal: warm start, then the job (the same display as
    ``temper watch``); plain lines when the output is not a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty() and os.environ.get("TERM") != "dumb"
        self.drawn = 0
        self.last: list[str] = []

    def show(self, lines: list[str]) -> None:
        if self.tty:
            if self.drawn:
                self.out.write(f"\x1b[{self.drawn}A")
            self.out.write("".join(f"\r\x1b[2K{line}\n" for line in lines))
            self.drawn = len(lines)
        elif lines != self.last:
            self.out.write("\n".join(lines) + "\n")
        self.last = lines
        self.out.flush()

    def done(self) -> None:
        self.drawn = 0
        self.last = []


async def run(
    spec_path: Path, *, runs_dir: Path = Path("runs"), run_id: str | None = None, out: TextIO | None = None
) -> RunResult:
    out = out or sys.stderr  # looked up now: tests and callers may have replaced it
    spec, local = localrun.load(spec_path)
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    run_dir = (runs_dir / run_id).resolve()
    if run_dir.exists():  # a run's database and objects are never mixed with another's
        raise StartupError(f"the run directory {run_dir} exists already; give another --run-id")
    run_dir.mkdir(parents=True)
    shutil.copy(spec_path, run_dir / "spec.yaml")
    out.write(f"temper run: {spec.name} -> {run_dir}\n")
    agent_url = agentrun.agent_url() if spec.environment.kind == AGENT_KIND else None
    engine = None
    if local.engine == "process":
        batch = spec.schedule.max_concurrent_episodes
        engine = EngineProcess(
            run_dir, run_dir / POLICY_DIR, port=free_port(), max_batch=batch, threads=cores.half()
        )
    settings = embedded_settings(
        run_dir, spec, agent_url=agent_url, engine_url=engine.url if engine else None
    )
    if engine is not None:  # the child's store and data directory are the run's
        engine.env.update(
            TEMPER_DATA_DIR=str(settings.data_dir),
            TEMPER_STORAGE__KIND=str(settings.storage.kind),
            TEMPER_STORAGE__ROOT=str(settings.storage.root),
        )
    if THREADS_ENV not in os.environ:
        cores.share(os.cpu_count() or 1)
    await asyncio.to_thread(upgrade, settings.db.url)
    runtime = Runtime(settings, service="temper-run")
    await runtime.start()
    progress = Progress(out)
    begun = time.perf_counter()
    try:
        first = [localrun.load(path) for path in local.before]
        for i, (before_spec, before_local) in enumerate(first):
            before_spec = await _store_taskset(runtime, before_spec, before_local)
            policy_dir = f"{before_spec.handle or f'before-{i}'}-v0"
            first[i] = (await asyncio.to_thread(make_policy, before_spec, before_local, run_dir, progress,
                                                policy_dir=policy_dir), before_local)  # fmt: skip
        spec = await _store_taskset(runtime, spec, local)
        if local.agent_dir is not None or local.image is not None:
            assert runtime.store is not None
            files = agentrun.agent_files(local.agent_dir) if local.agent_dir is not None else None
            image = await agentrun.publish_image(runtime.store, local.image) if local.image else None
            spec = agentrun.with_agent(spec, files=files, image=image)
        spec = await asyncio.to_thread(make_policy, spec, local, run_dir, progress)
        if engine is not None:
            await asyncio.to_thread(engine.start)
        parts = components(runtime)
        async with started(parts), agentrun.serving_agents(parts, agent_url) if agent_url else nullcontext():
            db, store = _db(runtime), runtime.store
            assert store is not None, "the embedded runtime has an object store"
            before: list[dict[str, Any]] = []
            for before_spec, _ in first:
                before_id = await _submit(runtime, before_spec)
                before_state = await _follow(runtime, before_id, progress)
                async with db.session() as session:
                    before.append(await _brief(session, before_id))
                if before_state != JobState.completed:
                    raise RuntimeError(
                        f"job {before_id} ({before_spec.name}), run before this one, ended {before_state}"
                    )
            job_id = await _submit(runtime, spec)
            state = await _follow(runtime, job_id, progress)
            tracking = spec.tracking
            if (tracking.mlflow is not None or tracking.wandb is not None) and not await _tracked(runtime):
                out.write(
                    f"tracking: not every event reached the tracking runs in {TRACKING_WAIT_S:.0f}s (see the log)\n"
                )
            async with db.session() as session:
                job = await _job(session, job_id)
                summary = await write_report(
                    session, store, job, run_dir, seconds=time.perf_counter() - begun, before=before
                )
    finally:
        await runtime.stop()
        cores.unshare()
        if engine is not None:
            await asyncio.to_thread(engine.stop)
    if summary.get("first_loss") is not None:
        algorithm = (spec.algorithm.name).value
        rewards = f"{algorithm} loss {summary['first_loss']:.4f} (first version) -> {summary['last_loss']:.4f} (last)"
    elif summary["reward_curve"]:
        rewards = (
            f"mean reward {summary['first_mean_reward']:.3f} (first iteration) -> "
            f"{summary['last_mean_reward']:.3f} (last)"
        )
    else:
        rewards = "no episode was scored"
    if summary.get("last_eval"):
        first, last = summary["first_eval"], summary["last_eval"]
        k = min(last["pass_at"], key=int)
        rewards += (
            f"; eval pass@{k} {_fraction(first['pass_at'].get(k))} (v{first['version']}) -> "
            f"{_fraction(last['pass_at'].get(k))} (v{last['version']})"
        )
    out.write(
        f"\n{state}: {rewards} in {summary['seconds']:.0f}s\nreport: {run_dir / 'report.html'}\n"
        f"console: temper serve --data-dir {run_dir}\n"
    )
    return RunResult(run_dir, job_id, state, summary)


def _fraction(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


TRACKING_WAIT_S = 60.0
THREADS_ENV = "TEMPER_TRAINER__THREADS"  # a fixed count: no core share


async def _tracked(runtime: Runtime, timeout_s: float = TRACKING_WAIT_S) -> bool:
    """Wait until the tracker has logged every lifecycle event (none left in the outbox, none
    behind its group on the in-process bus), so the run ends after its tracking runs did: the
    in-process bus holds the events in memory only. False after ``timeout_s``."""
    bus = runtime.bus
    assert isinstance(bus, InProcessBus), "temper run uses the in-process bus"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with _db(runtime).session() as s:
            unsent = await s.scalar(
                select(func.count()).where(OutboxRow.topic == Topics.EVENTS, OutboxRow.published_at.is_(None))
            )
        if not unsent and bus.lag(Topics.EVENTS, TRACKER_GROUP) == 0:
            return True
        await asyncio.sleep(0.1)
    return False


def _db(runtime: Runtime) -> Database:
    assert runtime.db is not None, "the embedded runtime has a database"
    return runtime.db


async def _job(session: AsyncSession, job_id: str) -> Job:
    job = await session.get(Job, job_id)
    if job is None:
        raise RuntimeError(f"job {job_id} vanished from the run's database")
    return job


async def _submit(runtime: Runtime, spec: JobSpec) -> str:
    """Submit a job of the run through the door's checks that apply here: its chat template
    renders what its episodes will, and the jobs it names (job:<job>@v<N> in a reward
    component's model) are resolved to their versions."""
    store = runtime.store
    assert store is not None, "the embedded runtime has an object store"
    async with _db(runtime).session() as session:
        tenant = await session.get(Tenant, TENANT)
        assert tenant is not None, "_store_taskset created the tenant"
        errors = await reward_model_errors(session, spec=spec, tenant_id=TENANT, store=store)
        if errors:
            raise SpecError(errors)
        # the door's template check, as POST /v1/jobs makes it: refused before any episode
        await check_template(session, spec=spec, store=store)
        job = await create_job(session, tenant=tenant, spec=spec, store=store)
        job_id = job.id
    log_event(log, "job submitted", job_id=job_id)
    return job_id


async def _brief(session: AsyncSession, job_id: str) -> dict[str, Any]:
    """What the summary says of a job run before the main one."""
    job = await _job(session, job_id)
    versions = (await job_metrics(session, job=job)).training.versions
    losses = [v.loss for v in versions if v.loss is not None]
    return {
        "job_id": job.id, "name": job.name, "handle": job.handle, "state": job.state,
        "algorithm": (job.spec.get("algorithm") or {}).get("name"), "policy_version": job.policy_version,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
    }  # fmt: skip


async def _store_taskset(runtime: Runtime, spec: JobSpec, local: localrun.LocalRun) -> JobSpec:
    """The task set (split as ``local.held_out`` says) in the run's database; the spec names it.
    A split that holds out none or all of the tasks, or an ``evaluation`` with no tasks in its
    split, is refused (:class:`SpecError`) before anything runs."""
    tasks = parse_tasks(local.taskset_file.read_bytes(), filename=local.taskset_file.name)
    async with _db(runtime).session() as session:
        if await session.get(Tenant, TENANT) is None:  # jobs run before this one made it
            session.add(Tenant(id=TENANT, name="local run", max_concurrent_episodes=1024))
            await session.flush()
        try:
            taskset = await create_taskset(
                session, runtime.store, TENANT, local.taskset_file.stem, tasks, source=str(local.taskset_file),
                held_out=local.held_out,
            )  # fmt: skip
        except SplitError as exc:
            raise SpecError([("local.held_out", str(exc))]) from None
        spec = spec.model_copy(update={"tasks": spec.tasks.model_copy(update={"taskset": taskset.id})})
        pools = {b.pool for b in runtime.settings.inference.backends}
        errors = await section_errors(session, spec, tenant_id=TENANT, pools=pools)
    if errors:
        raise SpecError([(f, m.replace("(temper tasksets upload --held-out 0.2, or held_out_fraction=0.2)",
                                       "(local.held_out: {fraction: 0.2})")) for f, m in errors])  # fmt: skip
    return spec


def make_policy(
    spec: JobSpec,
    local: localrun.LocalRun,
    run_dir: Path,
    progress: Progress,
    *,
    policy_dir: str = POLICY_DIR,
) -> JobSpec:
    """Make the policy, warm it up if the run asks, and save it as version 0; the gateway,
    the trainer and the dispatcher (for its tokenizer) all start from that directory.

    The model is ``policy.model`` when that names a model directory, else one built in
    the run (``local.build``: a BPE tokenizer trained here and a real architecture), else
    the CPU preset ``local.preset`` with the byte tokenizer."""
    pairs: list[tuple[dict[str, Any], Any]] = []
    if local.warm_start is not None:
        ws = local.warm_start
        pairs = localrun.generator(ws.generator)(ws.examples, seed=ws.seed)
    env = _environment(spec, {"prompt": ""})
    tools = env.tool_schemas()
    if is_model_dir(spec.policy.model):
        model, tok = load_model(spec.policy.model)
        source = spec.policy.model
    elif local.build is not None:
        model, tok = _build_model(spec, local, pairs, tools)
        source = f"{local.build.architecture} built in the run"
    else:
        model, tok = create_model(local.preset, seed=local.seed), byte_tokenizer()
        source = f"preset {local.preset}"
    if local.warm_start is not None:
        ws = local.warm_start
        conversations = [(_environment(spec, task).first_messages(), reply) for task, reply in pairs]
        t0 = time.perf_counter()

        def on_step(step: int, loss: float) -> None:
            if step % 20 == 0 or step == ws.steps - 1:
                bar_w = 40
                done = round((step + 1) / ws.steps * bar_w)
                progress.show(
                    [
                        f"warm start (supervised, {len(pairs)} teacher examples)",
                        f"[{'█' * done}{'░' * (bar_w - done)}] step {step + 1}/{ws.steps}  loss {loss:.4f}  "
                        f"{time.perf_counter() - t0:.0f}s",
                    ]
                )

        stats = warm_start(
            model, tok, conversations, steps=ws.steps, batch_size=ws.batch_size,
            learning_rate=ws.learning_rate, betas=ws.betas, seed=ws.seed, on_step=on_step, tools=tools,
            observation_role=env.tool_role,
        )  # fmt: skip
        progress.done()
        log_event(log, "warm start finished", loss=stats.loss, seconds=stats.seconds, tokens=stats.tokens)
    directory = run_dir / policy_dir
    save_checkpoint(model, directory, tokenizer=tok, metadata={"version": 0, "source": source})
    policy = spec.policy.model_copy(update={"init": str(directory)})
    return spec.model_copy(update={"policy": policy})


def _build_model(
    spec: JobSpec, local: localrun.LocalRun, pairs: list[tuple[dict[str, Any], Any]], tools: Any
) -> tuple[torch.nn.Module, ChatTokenizer]:
    """A BPE tokenizer trained on what the run's conversations say, and a random model of it."""
    from temper.policy.build import model_config, train_tokenizer

    b = local.build
    assert b is not None
    tasks = parse_tasks(local.taskset_file.read_bytes(), filename=local.taskset_file.name)
    conversations: list[list[dict[str, Any]]] = []
    for task, reply in pairs[:2000]:
        turns = [reply] if isinstance(reply, str | dict) else list(reply)
        roles = ["assistant", "tool"] * len(turns)
        said = [{"role": r, "content": turn_text(t)} for r, t in zip(roles, turns, strict=False)]
        conversations.append([*_environment(spec, task).first_messages(), *said])
    for t in tasks:
        conversations.append(_environment(spec, {"prompt": t.prompt}).first_messages())
    # twice: the first tokenizer only renders the template, so the second learns the
    # template's own text (tool instructions, headers) as well as the conversations'
    tok = train_tokenizer(
        [m["content"] for c in conversations for m in c], template=b.template, vocab_size=b.vocab_size
    )
    rendered = [tok.render_text(c, tools=tools, add_generation_prompt=False) for c in conversations]
    tok = train_tokenizer(rendered, template=b.template, vocab_size=b.vocab_size)
    cfg = model_config(
        b.architecture, tok, hidden_size=b.hidden_size, layers=b.layers, heads=b.heads, kv_heads=b.kv_heads
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(local.seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.float().eval(), tok


def _environment(spec: JobSpec, task: dict[str, Any]) -> Environment:
    """The environment an episode of this job runs, for a task like ``task``."""
    return make_environment(
        spec.environment.kind,
        {
            "id": "warm-start",
            "kind": spec.environment.kind,
            "prompt": task["prompt"],
            "spec": {"files": task.get("files", {})},
        },
        **environment_options(spec.environment),
    )


async def _follow(runtime: Runtime, job_id: str, progress: Progress) -> str:
    """Draw the job's progress until it ended and so did its evaluations: those of every
    version it published that is due (``evaluation.every_versions``), including a version the
    trainer publishes after the end (steps not yet checkpointed: it looks for ended jobs
    every ``JobTrainer.CLOSE_CHECK_S``)."""
    from temper.cli.jobs import progress_lines

    ended_at: float | None = None
    while True:
        async with _db(runtime).session() as session:
            job = await _job(session, job_id)
            metrics = (await job_metrics(session, job=job)).model_dump(mode="json")
            state = job.state
            name = job.name
            spec = JobSpec.model_validate(job.spec)
            published = set(
                (
                    await session.execute(select(PolicyVersion.version).where(PolicyVersion.job_id == job_id))
                ).scalars()
            )
        shown = {"id": job_id, "name": name, "algorithm": spec.algorithm.name.value}
        progress.show(progress_lines(shown, metrics, color=progress.tty))
        if JobState(state) in JOB_TERMINAL:
            ended_at = ended_at if ended_at is not None else time.monotonic()
            settled = (
                spec.algorithm.checkpoint_every == 1
                or time.monotonic() - ended_at > JobTrainer.CLOSE_CHECK_S + 1
            )
            if settled and not _evaluations_pending(spec, published, metrics["evaluations"]):
                progress.done()
                return state
        await asyncio.sleep(1.0)


def _evaluations_pending(spec: JobSpec, published: set[int], evaluations: list[dict[str, Any]]) -> bool:
    """Is an evaluation of the job still to come or to end?"""
    if spec.evaluation is None:
        return False
    every = spec.evaluation.every_versions
    due = {v for v in published | {0} if v % every == 0}
    made = {e["version"] for e in evaluations if e["periodic"]}
    return bool(due - made) or any(JobState(e["state"]) not in JOB_TERMINAL for e in evaluations)
