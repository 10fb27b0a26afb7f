"""The episode state machine.

Every handler here is one database transaction that (1) checks that the result it was
given is the one the episode is waiting for — same turn, step kind and attempt, step
still leased — and otherwise acknowledges and ignores it, (2) records the result on its
step row (unique per episode, turn and kind), (3) moves the episode with
:func:`temper.lifecycle.transition_episode`, and (4) writes the next command to the
outbox. A crash anywhere leaves either the old state (the result is redelivered) or the
new state with its command (the relay publishes it).

Episodes and steps have one data path: SQLAlchemy Core queries (``repo.py``) that give
detached ``Episode``/``Step`` rows, the lifecycle's rules on them, and their changes
staged on the transaction and written by ``temper.db.rows`` before it commits
(:meth:`EpisodeMachine.tx`). What a result leads to is ``turns.py``; retries and the
lease reaper ``leases.py``; the reward result ``rewards.py``.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher import agents, deadlines, leases, repo
from services.dispatcher.turns import Turns
from temper import faults, metrics
from temper.clock import utcnow
from temper.db import Database, Episode, Job, Step, Task, rows
from temper.db.core import CoreTx, core_of
from temper.envs import AgentEnvironment, Environment, environment_options, make_environment
from temper.events import InferenceResult, Message, SandboxResult
from temper.jobspec import JobSpec
from temper.lifecycle import STEP_WAITING, EpisodeState, fail_step, transition_episode
from temper.logs import log_context, log_event
from temper.policy.tokenizer import ChatTokenizer, TemplateError, fetch_policy_tokenizer, policy_tokenizer
from temper.settings import DispatcherSettings
from temper.storage import ObjectStore

log = logging.getLogger("temper.dispatcher.episodes")

E = EpisodeState
WAITING = tuple(s.value for s in STEP_WAITING)
ACTIVE = (E.pending, E.awaiting_action, E.acting, E.scoring)
STEP_FOR_STATE = repo.KIND_OF_STATE
TASK_COLUMNS = rows.columns(Task)
_JOB_SPEC = select(Job.__table__.c.spec).where(Job.__table__.c.id == bindparam("job_id"))
_TASK = select(*(Task.__table__.c[c] for c in TASK_COLUMNS)).where(
    Task.__table__.c.id == bindparam("task_id")
)


NO_AGENT_URL = "TEMPER_AGENT__URL is not set on the dispatcher: an agent's sandbox has no gateway to call"


def new_id() -> str:
    return uuid.uuid4().hex


def init_metrics() -> None:
    """Every episode state, failure reason (the prefix before ":" that transition_episode
    counts), step kind and expired-lease kind exports 0 from the start (metrics.zero says why)."""
    kinds = list(STEP_FOR_STATE.values())
    metrics.zero(metrics.EPISODE_TRANSITIONS, *E)
    metrics.zero(
        metrics.EPISODE_FAILURES,
        "lease_expired",
        "template_error",
        "agent_error",
        *(f"{k}_error" for k in kinds),
    )
    metrics.zero(metrics.TURN_SECONDS, *kinds)
    metrics.zero(metrics.STEP_LEASES_EXPIRED, *kinds, "trajectory")  # trajectory: the scheduler's


def _inference_error(msg: InferenceResult) -> str | None:
    """Why an inference result cannot be taken (its own error, or logprobs that do not match
    its tokens), or None."""
    if msg.error:
        return msg.error
    if len(msg.logprobs) != len(msg.token_ids):
        return f"{len(msg.logprobs)} logprobs for {len(msg.token_ids)} tokens"
    if msg.token_versions and len(msg.token_versions) != len(msg.token_ids):
        return f"{len(msg.token_versions)} token versions for {len(msg.token_ids)} tokens"
    return None


def is_current(ep: Episode | None, step: Step | None, message: Message, state: EpisodeState) -> str | None:
    """None if ``message`` is the result the episode waits for, else why not."""
    if ep is None:
        return "unknown episode"
    if ep.state != state:
        return f"episode is {ep.state}"
    if step is None or ep.turn != message.turn:
        return "not the current turn"
    if step.state not in WAITING:
        return "duplicate"
    if step.attempt != message.attempt:
        return f"stale attempt {message.attempt} (current {step.attempt})"
    return None


@dataclass
class _EnvOf:
    """A job's environment on one task, and its first prompt once rendered."""

    spec: JobSpec
    task: Task
    env: Environment
    first_prompt: list[int] | None = None


class EpisodeMachine:
    """Drives episodes from result to result. Stateless between calls except for caches
    of immutable rows (job specs, tasks), so any replica can handle any episode."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: DispatcherSettings,
        *,
        tokenizer: ChatTokenizer | None = None,
        transaction: Callable[[], AbstractAsyncContextManager[AsyncSession]] | None = None,
        core: Callable[[], AbstractAsyncContextManager[CoreTx]] | None = None,
        agent_url: str | None = None,
    ) -> None:
        init_metrics()
        self.agent_url = agent_url  # the gateway as agents' sandboxes reach it (TEMPER_AGENT__URL)
        self.db = db
        self.store = store
        self.settings = settings
        self.tok = tokenizer  # fixed by a caller (tests); else each job's policy tokenizer
        self.tokenizer_cache = Path(tempfile.gettempdir()) / "temper-tokenizers"
        self.turns = Turns(settings, self.tok_of)
        # The relay's transaction() and core() publish a handler's commands as soon as it commits.
        self._transaction = transaction or db.session
        self._core = core or db.core
        self._specs: OrderedDict[str, JobSpec] = OrderedDict()
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        self._toks: OrderedDict[int, tuple[JobSpec, ChatTokenizer]] = OrderedDict()
        self._envs: OrderedDict[tuple[int, str], _EnvOf] = OrderedDict()
        # SQLite has one writer: serialise this process's transactions instead of retrying "locked".
        self._sqlite_lock = asyncio.Lock() if db.is_sqlite else None
        self.ignored = 0  # results acknowledged without effect (duplicates, stale attempts)
        # Called when an episode finished (scored or failed): the scheduler may start another.
        self.on_finished: Callable[[], None] = lambda: None

    # --- plumbing ------------------------------------------------------------------------------
    @asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncSession]:
        """One ORM session's transaction (the scheduler's: jobs are ORM rows); the rows
        staged on it are written before it commits (``Database.session``), and its outbox
        rows are published once it has."""
        if self._sqlite_lock is not None:
            async with self._sqlite_lock, self._transaction() as session:
                yield session
        else:
            async with self._transaction() as session:
                yield session

    @asynccontextmanager
    async def core_tx(self) -> AsyncIterator[CoreTx]:
        """One transaction of Core statements (results, rewards, the reaper): on Postgres
        straight on asyncpg (``temper.db.core``); staged rows and outbox rows as :meth:`tx`."""
        if self._sqlite_lock is not None:
            async with self._sqlite_lock, self._core() as tx:
                yield tx
        else:
            async with self._core() as tx:
                yield tx

    def tok_of(self, spec: JobSpec) -> ChatTokenizer:
        """The job's policy tokenizer (looked up once per cached spec: the lookup stats files)."""
        if self.tok is not None:
            return self.tok
        found = self._toks.get(id(spec))
        if found is None or found[0] is not spec:
            found = self._toks[id(spec)] = (spec, policy_tokenizer(spec.policy.model, spec.policy.init))
            while len(self._toks) > 1000:
                self._toks.popitem(last=False)
        return found[1]

    async def spec_of(self, tx: CoreTx | AsyncSession, job_id: str) -> JobSpec:
        spec = self._specs.get(job_id)
        if spec is None:
            ((raw,),) = await (await core_of(tx)).rows(_JOB_SPEC, {"job_id": job_id})
            spec = JobSpec.model_validate(raw)
            await fetch_policy_tokenizer(
                self.store, spec.policy.model, spec.policy.init, self.tokenizer_cache
            )
            self._specs[job_id] = spec
            while len(self._specs) > 1000:
                self._specs.popitem(last=False)
        return spec

    async def task_of(self, tx: CoreTx | AsyncSession, task_id: str) -> Task:
        task = self._tasks.get(task_id)
        if task is None:
            found = await (await core_of(tx)).rows(_TASK, {"task_id": task_id})
            if not found:
                raise LookupError(f"task {task_id} does not exist")
            row = found[0]
            task = rows.loaded(Task, dict(zip(TASK_COLUMNS, row, strict=True)))
            self._tasks[task_id] = task
            while len(self._tasks) > 10_000:
                self._tasks.popitem(last=False)
        return task

    def environment(self, spec: JobSpec, task: Task) -> Environment:
        """The environment of a job's task: made once per cached spec and task (an
        environment is stateless; making one validates its tools), then reused."""
        found = self._envs.get((id(spec), task.id))
        if found is None or found.spec is not spec or found.task is not task:
            found = self._envs[(id(spec), task.id)] = _EnvOf(spec, task, self._make_environment(spec, task))
            while len(self._envs) > 10_000:
                self._envs.popitem(last=False)
        return found.env

    def first_prompt(self, spec: JobSpec, task: Task) -> list[int]:
        """The first prompt of a job's episodes on ``task`` (rendered once: a group's
        episodes share it). A copy: the caller's request owns it."""
        env = self.environment(spec, task)
        found = self._envs[(id(spec), task.id)]
        if found.first_prompt is None:
            found.first_prompt = env.first_prompt_ids(self.tok_of(spec))
        return list(found.first_prompt)

    def _make_environment(self, spec: JobSpec, task: Task) -> Environment:
        env = spec.environment
        return make_environment(
            env.kind or task.kind,
            task,
            max_observation_chars=self.settings.max_observation_chars,
            **environment_options(env),
        )

    def ignore(self, why: str, message: Message) -> None:
        self.ignored += 1
        log_event(log, "result ignored", logging.DEBUG, why=why, kind=message.kind, attempt=message.attempt)

    async def retry_or_fail(self, tx: CoreTx, ep: Episode, step: Step, reason: str) -> bool:
        """:func:`leases.retry_or_fail`, staging both rows; an episode that failed frees its slot."""
        rows.stage(tx, ep, step)
        retried = await leases.retry_or_fail(tx, self.settings, ep, step, reason)
        if not retried:
            self.on_finished()
        return retried

    # --- starting ------------------------------------------------------------------------------
    def start_episode(
        self,
        session: rows.HasInfo,
        *,
        job: Job,
        spec: JobSpec,
        task: Task,
        group_id: str,
        iteration: int,
        episode_id: str | None = None,
        behaviour_version: int | None = None,
        partial_rollouts: bool | None = None,
    ) -> Episode:
        """A pending episode that asks for its first action, staged in the caller's
        transaction (:meth:`tx` writes it). Its behaviour version is the job's current
        one (the scheduler says which; else ``job.policy_version``). ``partial_rollouts``:
        its own switch, the job's ``schedule.partial_rollouts`` unless given (an
        evaluation episode passes False: it is sampled by the version it evaluates)."""
        episode_id = episode_id or new_id()
        now = utcnow()
        ep = rows.new(
            Episode,
            id=episode_id,
            job_id=job.id,
            tenant_id=job.tenant_id,
            task_id=task.id,
            group_id=group_id,
            iteration=iteration,
            state=E.pending,
            state_reason=None,
            turn=0,
            attempt=0,
            format_errors=0,
            behaviour_version=job.policy_version if behaviour_version is None else behaviour_version,
            reward=None,
            rewards={},
            session_id=episode_id,
            snapshot_key=None,
            trajectory_key=None,
            lease_expires_at=None,
            timings={"started_at": now.timestamp()},
            sandbox_cpu_s=0.0,
            sandbox_memory_gb_s=0.0,
            inference_tokens=0,
            partial_rollouts=spec.schedule.partial_rollouts if partial_rollouts is None else partial_rollouts,
            deadline_at=deadlines.deadline_of(spec, now),
            model_tokens=0,
            created_at=now,
            updated_at=now,
        )
        env = self.environment(spec, task)
        if isinstance(env, AgentEnvironment):  # its agent runs, and calls the policy itself
            if self.agent_url is None:
                transition_episode(session, ep, E.failed, reason=f"agent_error: {NO_AGENT_URL}")
                rows.stage(session, ep)
                self.on_finished()
                return ep
            step = agents.start_run(self.turns, session, ep, spec, env, gateway_url=self.agent_url)
            rows.stage(session, ep, step)
            return ep
        prompt = self.first_prompt(spec, task)
        request = self.turns.inference_request(ep, spec, prompt, turn=0)
        step = self.turns.issue(session, ep, "inference", request)
        transition_episode(session, ep, E.awaiting_action)
        rows.stage(session, ep, step)
        return ep

    # --- results -------------------------------------------------------------------------------
    async def on_inference(self, msg: InferenceResult) -> None:
        await self.on_results([msg])

    async def on_sandbox(self, msg: SandboxResult) -> None:
        await self.on_results([msg])

    async def on_results(self, messages: Sequence[InferenceResult | SandboxResult]) -> None:
        """Inference results, or sandbox results, of distinct episodes, in one transaction:
        one query locks their episodes (in id order) with the steps they answer, each result
        is checked and taken or ignored exactly as alone, and the writes go out in bulk
        (one statement per table and set of columns), the outbox rows with them. Any error
        rolls all of them back and is raised: the caller then hands the results over one at
        a time (``temper.bus`` does)."""
        if not messages:
            return
        kind = "inference" if isinstance(messages[0], InferenceResult) else "sandbox"
        wanted = InferenceResult if kind == "inference" else SandboxResult
        ids = [m.episode_id for m in messages]
        if not all(isinstance(m, wanted) for m in messages) or None in ids or len(set(ids)) < len(ids):
            raise ValueError("a batch is results of one kind, of distinct episodes")
        state = E.acting if kind == "sandbox" else E.awaiting_action
        async with self.core_tx() as tx:
            locked = await repo.lock_episodes(tx, sorted(i for i in ids if i), kind)
            for msg in messages:
                with log_context(
                    job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt
                ):
                    await self._take(tx, msg, locked.get(msg.episode_id or ""), state)
            await faults.hold("dispatcher.batch", work=len(messages), kind=kind)

    async def _take(
        self,
        tx: CoreTx,
        msg: InferenceResult | SandboxResult,
        found: repo.Locked | None,
        state: EpisodeState,
    ) -> None:
        ep, step, inference, prompt_tokens = found or (None, None, None, 0)
        why = is_current(ep, step, msg, state)
        if why:
            return self.ignore(why, msg)
        assert ep is not None and step is not None
        error = _inference_error(msg) if isinstance(msg, InferenceResult) else msg.error
        if error:
            await self.retry_or_fail(tx, ep, step, f"{step.kind}_error: {error}")
            return None
        spec = await self.spec_of(tx, ep.job_id)
        env = self.environment(spec, await self.task_of(tx, ep.task_id))
        try:
            if isinstance(msg, SandboxResult) and isinstance(env, AgentEnvironment):
                issued = await agents.take_run(self.turns, tx, ep, step, msg, spec, env)
                if issued is None:  # it made no model call: failed
                    self.on_finished()
            elif isinstance(msg, SandboxResult):
                assert inference is not None
                issued = self.turns.take_sandbox(tx, ep, step, inference, msg, spec, env)
            else:
                issued = await self.turns.take_inference(tx, ep, step, msg, spec, env, prompt_tokens)
        except TemplateError as exc:
            # the chat template cannot render this turn: no retry renders it either, so the
            # episode fails now with the template's own error (never a lease expiry later)
            self.template_failed(tx, ep, step, exc)
            rows.stage(tx, ep, step, inference)
            return None
        rows.stage(tx, ep, step, inference, issued)
        return None

    def template_failed(self, tx: CoreTx, ep: Episode, step: Step, exc: TemplateError) -> None:
        """Fail ``ep`` at once with ``template_error: <the template's error>``; its result
        stays recorded on ``step``."""
        if step.state in WAITING:
            fail_step(step)
        reason = f"template_error: {exc}"[:2000]
        transition_episode(tx, ep, E.failed, reason=reason)
        log_event(log, "episode failed", logging.WARNING, reason=reason, attempts=step.attempt + 1)
        self.on_finished()

    # --- leases --------------------------------------------------------------------------------
    async def reap_expired(self, limit: int = 200) -> int:
        """Retry (or fail) every step whose lease expired, or end the episodes whose deadline
        it was (:meth:`end_at_deadline`); returns how many."""
        reaped = await leases.reap_expired(
            self.core_tx, self.settings, limit, on_deadline=self.end_at_deadline
        )
        if reaped:
            self.on_finished()  # some may have failed
        return reaped

    async def end_at_deadline(self, tx: CoreTx, ep: Episode, step: Step) -> Step:
        """``ep`` reached its ``max_episode_s`` while ``step`` (an inference or sandbox step)
        was out: the step is given up (a late result is ignored), and the episode is scored
        with what it left. Returns the reward step."""
        fail_step(step)
        spec = await self.spec_of(tx, ep.job_id)
        env = self.environment(spec, await self.task_of(tx, ep.task_id))
        log_event(log, "episode reached its deadline", kind=step.kind, turn=ep.turn)
        # the answered step's result is not read here: the episode is scored on its workspace
        return self.turns.end_early(tx, ep, spec, env, None, deadlines.MAX_EPISODE_S)

    def describe(self) -> dict[str, Any]:
        return {"ignored_results": self.ignored}
