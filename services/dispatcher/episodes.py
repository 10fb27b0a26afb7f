"""The episode state machine.

Every handler here is one database transaction that (1) checks that the result it was
given is the one the episode is waiting for — same turn, step kind and attempt, step
still leased — and otherwise acknowledges and ignores it, (2) records the result on its
step row (unique per episode, turn and kind), (3) moves the episode with
:func:`temper.lifecycle.transition_episode`, and (4) writes the next command to the
outbox. A crash anywhere leaves either the old state (the result is redelivered) or the
new state with its command (the relay publishes it).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Select, and_, bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from services.dispatcher.fairshare import inference_tokens, sandbox_cpu_s, sandbox_memory_gb_s
from services.dispatcher.trajectories import build_trajectory
from temper import metrics
from temper.clock import utcnow
from temper.db import Database, Episode, Job, Step, Task
from temper.envs import Environment, ParsedAction, make_environment
from temper.episode_log import build_episode_log, log_key
from temper.events import (
    InferenceRequest,
    InferenceResult,
    LifecycleEvent,
    Message,
    RewardRequest,
    RewardResult,
    SamplingParams,
    SandboxRequest,
    SandboxResult,
    Topics,
    TrajectoryReady,
)
from temper.jobspec import PACKAGE_KIND, JobSpec
from temper.lifecycle import (
    STEP_WAITING,
    EpisodeRow,
    EpisodeState,
    StepRow,
    complete_step,
    fail_step,
    new_step_values,
    retry_step,
    transition_episode,
    write_rows,
)
from temper.logs import log_context, log_event
from temper.outbox import enqueue
from temper.policy.tokenizer import (
    ChatTokenizer,
    assistant_stop_ids,
    fetch_policy_tokenizer,
    policy_tokenizer,
)
from temper.rewards import passed
from temper.settings import DispatcherSettings
from temper.storage import ObjectStore, object_key
from temper.tasks.service import record_outcome

log = logging.getLogger("temper.dispatcher.episodes")

E = EpisodeState
WAITING = tuple(s.value for s in STEP_WAITING)
ACTIVE = (E.pending, E.awaiting_action, E.acting, E.scoring)
STEP_FOR_STATE = {E.awaiting_action: "inference", E.acting: "sandbox", E.scoring: "reward"}
TOPIC_FOR_KIND = {
    "inference": Topics.INFERENCE_REQUESTS,
    "sandbox": Topics.SANDBOX_REQUESTS,
    "reward": Topics.REWARD_REQUESTS,
}
REQUEST_TYPES: dict[str, type[Message]] = {
    "inference": InferenceRequest,
    "sandbox": SandboxRequest,
    "reward": RewardRequest,
}


def new_id() -> str:
    return uuid.uuid4().hex


_EP_COLS, _STEP_COLS = EpisodeRow.COLUMNS, StepRow.COLUMNS
_N_EP, _N_STEP = len(_EP_COLS), len(_STEP_COLS)


def _lock_statement(*, for_update: bool, with_inference: bool) -> Select[Any]:
    """The episode (locked), its step of turn ``:turn`` and kind ``:kind`` and, with
    ``with_inference``, that turn's inference step: one query, every column of each, with
    Core (built once; executing it again compiles nothing)."""
    ep = Episode.__table__
    step = Step.__table__.alias("step")
    joined = ep.outerjoin(
        step,
        and_(
            step.c.episode_id == ep.c.id, step.c.turn == bindparam("turn"), step.c.kind == bindparam("kind")
        ),
    )
    columns = [*(ep.c[c] for c in _EP_COLS), *(step.c[c] for c in _STEP_COLS)]
    if with_inference:
        inference = Step.__table__.alias("inference")
        joined = joined.outerjoin(
            inference,
            and_(
                inference.c.episode_id == ep.c.id,
                inference.c.turn == bindparam("turn"),
                inference.c.kind == "inference",
            ),
        )
        columns += [inference.c[c] for c in _STEP_COLS]
    query = select(*columns).select_from(joined).where(ep.c.id == bindparam("episode_id"))
    return query.with_for_update(of=ep) if for_update else query


def _lock_many_statement(*, for_update: bool, with_inference: bool) -> Select[Any]:
    """As :func:`_lock_statement` for the episodes ``:ids`` (locked in id order), each
    with its step of kind ``:kind`` of the episode's current turn (a result of another
    turn is not awaited, whatever its step)."""
    ep = Episode.__table__
    step = Step.__table__.alias("step")
    joined = ep.outerjoin(
        step, and_(step.c.episode_id == ep.c.id, step.c.turn == ep.c.turn, step.c.kind == bindparam("kind"))
    )
    columns = [*(ep.c[c] for c in _EP_COLS), *(step.c[c] for c in _STEP_COLS)]
    if with_inference:
        inference = Step.__table__.alias("inference")
        joined = joined.outerjoin(
            inference,
            and_(
                inference.c.episode_id == ep.c.id,
                inference.c.turn == ep.c.turn,
                inference.c.kind == "inference",
            ),
        )
        columns += [inference.c[c] for c in _STEP_COLS]
    query = (
        select(*columns)
        .select_from(joined)
        .where(ep.c.id.in_(bindparam("ids", expanding=True)))
        .order_by(ep.c.id)
    )
    return query.with_for_update(of=ep) if for_update else query


_LOCK_MANY_STATEMENTS = {
    (for_update, with_inference): _lock_many_statement(for_update=for_update, with_inference=with_inference)
    for for_update in (True, False)
    for with_inference in (True, False)
}
_LOCK_STATEMENTS = {
    (for_update, with_inference): _lock_statement(for_update=for_update, with_inference=with_inference)
    for for_update in (True, False)
    for with_inference in (True, False)
}


def _step_row(values: tuple[Any, ...]) -> StepRow | None:
    return StepRow(dict(zip(_STEP_COLS, values, strict=True))) if values[0] is not None else None


def init_metrics() -> None:
    """Every episode state, failure reason (the prefix before ":" that transition_episode
    counts), step kind and expired-lease kind exports 0 from the start (metrics.zero says why)."""
    kinds = list(STEP_FOR_STATE.values())
    metrics.zero(metrics.EPISODE_TRANSITIONS, *E)
    metrics.zero(metrics.EPISODE_FAILURES, "lease_expired", *(f"{k}_error" for k in kinds))
    metrics.zero(metrics.TURN_SECONDS, *kinds)
    metrics.zero(metrics.STEP_LEASES_EXPIRED, *kinds, "trajectory")  # trajectory: the scheduler's


def _inference_error(msg: InferenceResult) -> str | None:
    """Why an inference result cannot be taken (its own error, or logprobs that do not match
    its tokens), or None."""
    if msg.error:
        return msg.error
    if len(msg.logprobs) != len(msg.token_ids):
        return f"{len(msg.logprobs)} logprobs for {len(msg.token_ids)} tokens"
    return None


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
    ) -> None:
        init_metrics()
        self.db = db
        self.store = store
        self.settings = settings
        self.tok = tokenizer  # fixed by a caller (tests); else each job's policy tokenizer
        self.tokenizer_cache = Path(tempfile.gettempdir()) / "temper-tokenizers"
        # The relay's transaction() publishes a handler's commands as soon as it commits.
        self._transaction = transaction or db.session
        self._specs: OrderedDict[str, JobSpec] = OrderedDict()
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        # SQLite has one writer: serialise this process's transactions instead of retrying "locked".
        self._sqlite_lock = asyncio.Lock() if db.is_sqlite else None
        self.ignored = 0  # results acknowledged without effect (duplicates, stale attempts)

    # --- plumbing ------------------------------------------------------------------------------
    @asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncSession]:
        """One transaction; its outbox rows are published once it commits."""
        if self._sqlite_lock is not None:
            async with self._sqlite_lock, self._transaction() as session:
                yield session
        else:
            async with self._transaction() as session:
                yield session

    def tok_of(self, spec: JobSpec) -> ChatTokenizer:
        return self.tok or policy_tokenizer(spec.policy.model, spec.policy.init)

    async def spec_of(self, session: AsyncSession, job_id: str) -> JobSpec:
        spec = self._specs.get(job_id)
        if spec is None:
            raw = await session.scalar(select(Job.spec).where(Job.id == job_id))
            spec = JobSpec.model_validate(raw)
            await fetch_policy_tokenizer(
                self.store, spec.policy.model, spec.policy.init, self.tokenizer_cache
            )
            self._specs[job_id] = spec
            while len(self._specs) > 1000:
                self._specs.popitem(last=False)
        return spec

    async def task_of(self, session: AsyncSession, task_id: str) -> Task:
        task = self._tasks.get(task_id)
        if task is None:
            task = await session.get(Task, task_id)
            if task is None:
                raise LookupError(f"task {task_id} does not exist")
            session.expunge(task)
            self._tasks[task_id] = task
            while len(self._tasks) > 10_000:
                self._tasks.popitem(last=False)
        return task

    def environment(self, spec: JobSpec, task: Task) -> Environment:
        env = spec.environment
        return make_environment(
            env.kind or task.kind,
            task,
            max_turns=env.max_turns,
            action_format=env.action_format,
            limits=env.limits,
            max_observation_chars=self.settings.max_observation_chars,
            system_prompt=env.system_prompt,
            tools=env.tools,
            **({"package": env.package} if env.kind == PACKAGE_KIND else {}),
        )

    async def _lock_with_step(
        self, session: AsyncSession, episode_id: str | None, turn: int, kind: str
    ) -> tuple[Episode | None, Step | None]:
        """The episode, locked, and its step of ``turn`` and ``kind``, in one query."""
        if not episode_id:
            return None, None
        query = (
            select(Episode, Step)
            .outerjoin(Step, and_(Step.episode_id == Episode.id, Step.turn == turn, Step.kind == kind))
            .where(Episode.id == episode_id)
        )
        if not self.db.is_sqlite:
            query = query.with_for_update(of=Episode)
        row = (await session.execute(query)).one_or_none()
        return (row[0], row[1]) if row is not None else (None, None)

    @staticmethod
    async def _step(session: AsyncSession, episode_id: str, turn: int, kind: str) -> Step | None:
        return (
            await session.execute(
                select(Step).where(Step.episode_id == episode_id, Step.turn == turn, Step.kind == kind)
            )
        ).scalar_one_or_none()

    def _lease(self, kind: str, extra_s: float = 0.0) -> datetime:
        lease = self.settings.lease_s
        if kind == "reward" and self.settings.reward_lease_s:
            lease = self.settings.reward_lease_s
        return utcnow() + timedelta(seconds=lease + extra_s)

    def _issue(
        self,
        session: AsyncSession,
        ep: Episode | EpisodeRow,
        kind: str,
        message: Message,
        *,
        extra_s: float = 0.0,
    ) -> None:
        """Write a new step (attempt 0) and its command; the episode waits on it. An ORM
        episode's step goes into the session; a Core row's into its ``new_steps``, which
        ``write_rows`` inserts."""
        lease = self._lease(kind, extra_s)
        values = new_step_values(
            episode_id=ep.id,
            turn=message.turn or 0,
            kind=kind,
            request=message.model_dump(mode="json"),
            lease_expires_at=lease,
        )
        if isinstance(ep, EpisodeRow):
            ep.new_steps.append(values)
        else:
            session.add(Step(**values))
        ep.turn = message.turn or 0
        ep.attempt = 0
        ep.lease_expires_at = lease
        enqueue(session, TOPIC_FOR_KIND[kind], message)

    def _ignore(self, why: str, message: Message) -> None:
        self.ignored += 1
        log_event(log, "result ignored", logging.DEBUG, why=why, kind=message.kind, attempt=message.attempt)

    async def _awaited(
        self, session: AsyncSession, msg: Message, kind: str, state: EpisodeState, error: str | None
    ) -> tuple[Episode, Step] | None:
        """The locked episode and step this result answers, or None when it is stale or a
        duplicate (ignored) or reports an error (the step is retried or the episode fails)."""
        ep, step = await self._lock_with_step(session, msg.episode_id, msg.turn or 0, kind)
        why = self._is_current(ep, step, msg, state)
        if why:
            self._ignore(why, msg)
            return None
        assert ep is not None and step is not None
        if error:
            self.retry_or_fail(session, ep, step, f"{kind}_error: {error}")
            return None
        return ep, step

    async def _lock_rows(
        self, conn: AsyncConnection, episode_id: str | None, turn: int, kind: str, *, with_inference: bool
    ) -> tuple[EpisodeRow | None, StepRow | None, StepRow | None]:
        """The episode, locked, its step of ``turn`` and ``kind`` and (``with_inference``)
        that turn's inference step, as Core rows, in one query."""
        if not episode_id:
            return None, None, None
        query = _LOCK_STATEMENTS[(not self.db.is_sqlite, with_inference)]
        row = (await conn.execute(query, {"episode_id": episode_id, "turn": turn, "kind": kind})).first()
        if row is None:
            return None, None, None
        values = tuple(row)
        ep = EpisodeRow(dict(zip(_EP_COLS, values[:_N_EP], strict=True)))
        step = _step_row(values[_N_EP : _N_EP + _N_STEP])
        inference = _step_row(values[_N_EP + _N_STEP :]) if with_inference else None
        return ep, step, inference

    async def _lock_many(
        self, conn: AsyncConnection, episode_ids: list[str], kind: str, *, with_inference: bool
    ) -> dict[str, tuple[EpisodeRow, StepRow | None, StepRow | None]]:
        """:meth:`_lock_rows` for several episodes in one query (locked in id order), each
        with its step of ``kind`` of its current turn."""
        query = _LOCK_MANY_STATEMENTS[(not self.db.is_sqlite, with_inference)]
        found: dict[str, tuple[EpisodeRow, StepRow | None, StepRow | None]] = {}
        for row in await conn.execute(query, {"ids": episode_ids, "kind": kind}):
            values = tuple(row)
            ep = EpisodeRow(dict(zip(_EP_COLS, values[:_N_EP], strict=True)))
            step = _step_row(values[_N_EP : _N_EP + _N_STEP])
            inference = _step_row(values[_N_EP + _N_STEP :]) if with_inference else None
            found[ep.id] = (ep, step, inference)
        return found

    async def _awaited_rows(
        self,
        session: AsyncSession,
        conn: AsyncConnection,
        msg: Message,
        kind: str,
        state: EpisodeState,
        error: str | None,
        *,
        with_inference: bool = False,
    ) -> tuple[EpisodeRow, StepRow, StepRow | None] | None:
        """As :meth:`_awaited`, on Core rows: the locked episode, the step this result
        answers and (``with_inference``) that turn's inference step, or None when the result
        is stale, a duplicate, or an error (then the retry or failure is written here)."""
        ep, step, inference = await self._lock_rows(
            conn, msg.episode_id, msg.turn or 0, kind, with_inference=with_inference
        )
        why = self._is_current(ep, step, msg, state)
        if why:
            self._ignore(why, msg)
            return None
        assert ep is not None and step is not None
        if error:
            self.retry_or_fail(session, ep, step, f"{kind}_error: {error}")
            await write_rows(conn, ep, step)
            return None
        return ep, step, inference

    @staticmethod
    def _is_current(
        ep: Episode | EpisodeRow | None, step: Step | StepRow | None, message: Message, state: EpisodeState
    ) -> str | None:
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

    def retry_or_fail(
        self, session: AsyncSession, ep: Episode | EpisodeRow, step: Step | StepRow, reason: str
    ) -> bool:
        """Re-send ``step`` with the next attempt, or fail the episode once attempts run out.
        Returns True when it retried."""
        if step.attempt + 1 < self.settings.max_step_attempts:
            retry_step(step, lease_expires_at=self._lease(step.kind))
            ep.attempt = step.attempt
            ep.lease_expires_at = step.lease_expires_at
            payload = {
                **step.request,
                "id": str(uuid.uuid4()),
                "occurred_at": utcnow().isoformat(),
                "attempt": step.attempt,
            }
            if step.kind == "sandbox":
                payload["snapshot_key"] = ep.snapshot_key
            message = REQUEST_TYPES[step.kind].model_validate(payload)
            enqueue(session, TOPIC_FOR_KIND[step.kind], message)
            log_event(
                log, "step retried", logging.WARNING, kind=step.kind, attempt=step.attempt, reason=reason
            )
            return True
        fail_step(step)
        transition_episode(session, ep, E.failed, reason=f"{reason} (after {step.attempt + 1} attempts)")
        log_event(log, "episode failed", logging.WARNING, reason=reason, attempts=step.attempt + 1)
        return False

    # --- starting ------------------------------------------------------------------------------
    def start_episode(
        self,
        session: AsyncSession,
        *,
        job: Job,
        spec: JobSpec,
        task: Task,
        group_id: str,
        iteration: int,
        episode_id: str | None = None,
    ) -> Episode:
        """Insert a pending episode and ask for its first action, in the caller's transaction."""
        ep = Episode(
            id=episode_id or new_id(),
            job_id=job.id,
            tenant_id=job.tenant_id,
            task_id=task.id,
            group_id=group_id,
            iteration=iteration,
            state=E.pending,
            turn=0,
            attempt=0,
            behaviour_version=job.policy_version,
            session_id=None,
            rewards={},
            timings={"started_at": utcnow().timestamp()},
            created_at=utcnow(),
        )
        ep.session_id = ep.id
        session.add(ep)
        env = self.environment(spec, task)
        prompt = env.first_prompt_ids(self.tok_of(spec))
        self._issue(session, ep, "inference", self._inference_request(ep, spec, prompt, turn=0))
        transition_episode(session, ep, E.awaiting_action)
        return ep

    def _inference_request(
        self, ep: Episode | EpisodeRow, spec: JobSpec, prompt_ids: list[int], *, turn: int
    ) -> InferenceRequest:
        s = spec.policy.sampling
        return InferenceRequest(
            job_id=ep.job_id,
            episode_id=ep.id,
            turn=turn,
            model=spec.policy.model,
            init=spec.policy.init,
            pool=spec.policy.backend_pool,
            prompt_ids=prompt_ids,
            sampling=SamplingParams(
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                stop=list(s.stop),
                stop_token_ids=assistant_stop_ids(self.tok_of(spec)),
            ),
        )

    # --- results -------------------------------------------------------------------------------
    async def on_inference(self, msg: InferenceResult) -> None:
        async with self.tx() as session:
            conn = await session.connection()
            error = _inference_error(msg)
            awaited = await self._awaited_rows(session, conn, msg, "inference", E.awaiting_action, error)
            if awaited is None:
                return
            ep, step, _ = awaited
            spec = await self.spec_of(session, ep.job_id)
            env = self.environment(spec, await self.task_of(session, ep.task_id))
            self._take_inference(session, ep, step, msg, spec, env)
            await write_rows(conn, ep, step)

    async def on_results(self, messages: Sequence[InferenceResult | SandboxResult]) -> None:
        """Inference results, or sandbox results, of distinct episodes, in one transaction:
        one query locks their episodes (in id order) with the steps they answer, each result
        is checked, taken or ignored exactly as :meth:`on_inference` / :meth:`on_sandbox`
        take it alone, and the writes go out in bulk (one statement per kind of change),
        the outbox rows with them. Any error rolls all of them back and is raised: the
        caller then hands the results over one at a time (``temper.bus`` does)."""
        if not messages:
            return
        kind = "inference" if isinstance(messages[0], InferenceResult) else "sandbox"
        wanted = InferenceResult if kind == "inference" else SandboxResult
        ids = [m.episode_id for m in messages]
        if not all(isinstance(m, wanted) for m in messages) or None in ids or len(set(ids)) < len(ids):
            raise ValueError("a batch is results of one kind, of distinct episodes")
        sandbox = kind == "sandbox"
        state = E.acting if sandbox else E.awaiting_action
        async with self.tx() as session:
            conn = await session.connection()
            locked = await self._lock_many(conn, [i for i in ids if i], kind, with_inference=sandbox)
            touched: list[EpisodeRow | StepRow | None] = []
            for msg in messages:
                ep, step, inference = locked.get(msg.episode_id or "", (None, None, None))
                with log_context(
                    job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt
                ):
                    why = self._is_current(ep, step, msg, state)
                    if why:
                        self._ignore(why, msg)
                        continue
                    assert ep is not None and step is not None
                    touched += [ep, step]
                    error = _inference_error(msg) if isinstance(msg, InferenceResult) else msg.error
                    if error:
                        self.retry_or_fail(session, ep, step, f"{kind}_error: {error}")
                        continue
                    spec = await self.spec_of(session, ep.job_id)
                    env = self.environment(spec, await self.task_of(session, ep.task_id))
                    if isinstance(msg, SandboxResult):
                        assert inference is not None
                        self._take_sandbox(session, ep, step, inference, msg, spec, env)
                        touched.append(inference)
                    else:
                        self._take_inference(session, ep, step, msg, spec, env)
            await write_rows(conn, *touched)

    def _take_inference(
        self,
        session: AsyncSession,
        ep: EpisodeRow,
        step: StepRow,
        msg: InferenceResult,
        spec: JobSpec,
        env: Environment,
    ) -> None:
        """Record the awaited inference result on ``step`` and issue what comes next."""
        ep.inference_tokens = (ep.inference_tokens or 0) + inference_tokens(step.request, msg)
        text = msg.text or self.tok_of(spec).decode(msg.token_ids)
        action = env.parse(text, turn=step.turn)
        complete_step(
            step,
            {
                "token_ids": msg.token_ids,
                "logprobs": msg.logprobs,
                "text": text,
                "finish_reason": msg.finish_reason,
                "policy_version": msg.policy_version,
                "backend": msg.backend,
                "answered_at": msg.occurred_at.isoformat(),
                "action": action.to_dict(),
            },
        )
        self._observe_step(step)
        if ep.behaviour_version is None or msg.policy_version < ep.behaviour_version:
            ep.behaviour_version = msg.policy_version
        turn = step.turn
        if action.kind == "sandbox":
            assert action.command is not None
            limits = env.limits or None
            request = SandboxRequest(
                job_id=ep.job_id,
                episode_id=ep.id,
                turn=turn,
                session_id=ep.session_id or ep.id,
                action=action.command,
                more_actions=action.more or [],
                limits=limits,
                snapshot_key=ep.snapshot_key,
                files=env.setup_files() if ep.snapshot_key is None else {},
                setup=env.setup_actions() if ep.snapshot_key is None else [],
            )
            # The lease covers the actions' own wall-clock limits on top of the hop.
            actions = 1 + len(action.more or [])
            wall_s = actions * float((limits or {}).get("wall_s", 0.0))
            self._issue(session, ep, "sandbox", request, extra_s=wall_s)
            transition_episode(session, ep, E.acting)
            return
        if not action.format_ok:
            ep.format_errors = (ep.format_errors or 0) + 1
        if action.kind == "submit" or env.is_last_turn(turn):
            self._issue_reward(session, ep, spec, env, action, final_text=text)
            return
        # A malformed action: its error is the observation, and the model tries again.
        observations = env.observe(action, None)
        step.result = {**(step.result or {}), "observation": observations[0]}
        self._next_turn(session, ep, spec, env, step, observations)

    async def on_sandbox(self, msg: SandboxResult) -> None:
        async with self.tx() as session:
            conn = await session.connection()
            awaited = await self._awaited_rows(
                session, conn, msg, "sandbox", E.acting, msg.error, with_inference=True
            )
            if awaited is None:
                return
            ep, step, inference = awaited
            assert inference is not None and inference.result is not None
            spec = await self.spec_of(session, ep.job_id)
            env = self.environment(spec, await self.task_of(session, ep.task_id))
            self._take_sandbox(session, ep, step, inference, msg, spec, env)
            await write_rows(conn, ep, step, inference)

    def _take_sandbox(
        self,
        session: AsyncSession,
        ep: EpisodeRow,
        step: StepRow,
        inference: StepRow,
        msg: SandboxResult,
        spec: JobSpec,
        env: Environment,
    ) -> None:
        """Record the awaited sandbox result on ``step`` and issue what comes next."""
        assert inference.result is not None
        ep.sandbox_cpu_s = (ep.sandbox_cpu_s or 0.0) + sandbox_cpu_s(msg)
        ep.sandbox_memory_gb_s = (ep.sandbox_memory_gb_s or 0.0) + sandbox_memory_gb_s(msg)
        action = ParsedAction.from_dict(inference.result["action"])
        observations = env.observe(action, msg.result, msg.more_results)
        complete_step(
            step,
            {
                "exec": msg.result,
                **({"more_exec": msg.more_results} if msg.more_results else {}),
                "worker": msg.worker,
                "snapshot_key": msg.snapshot_key,
                "observation": "\n\n".join(observations),
                **({"observations": observations} if len(observations) > 1 else {}),
            },
        )
        self._observe_step(step)
        if msg.snapshot_key:
            ep.snapshot_key = msg.snapshot_key
        if action.submit_after or env.is_last_turn(step.turn):
            self._issue_reward(session, ep, spec, env, action, final_text=inference.result.get("text", ""))
            return
        self._next_turn(session, ep, spec, env, inference, observations)

    def _next_turn(
        self,
        session: AsyncSession,
        ep: EpisodeRow,
        spec: JobSpec,
        env: Environment,
        inference: StepRow,
        observations: list[str],
    ) -> None:
        """Extend the conversation token-wise with ``observations`` (one message per tool
        call) and ask for the next action."""
        sampled = inference.result["token_ids"] if inference.result else []
        prompt = [
            *inference.request["prompt_ids"],
            *sampled,
            *env.observation_ids(self.tok_of(spec), sampled, observations),
        ]
        if len(prompt) + spec.policy.sampling.max_tokens > self.settings.max_context_tokens:
            # Out of context: score what there is.
            action = ParsedAction.from_dict((inference.result or {}).get("action", {"kind": "invalid"}))
            ep.timings = {**ep.timings, "context_full": True}
            self._issue_reward(
                session, ep, spec, env, action, final_text=(inference.result or {}).get("text", "")
            )
            return
        self._issue(
            session, ep, "inference", self._inference_request(ep, spec, prompt, turn=inference.turn + 1)
        )
        transition_episode(session, ep, E.awaiting_action)

    def _issue_reward(
        self,
        session: AsyncSession,
        ep: EpisodeRow,
        spec: JobSpec,
        env: Environment,
        action: ParsedAction,
        *,
        final_text: str,
    ) -> None:
        format_ok = not ep.format_errors  # over every turn, this one included
        request = RewardRequest(
            job_id=ep.job_id,
            episode_id=ep.id,
            turn=ep.turn,
            task_id=ep.task_id,
            taskset_id=env.task.meta.get("task_set_id") or spec.tasks.taskset,
            submission=env.submission(
                action if action.kind != "invalid" else None,
                final_text=final_text,
                snapshot_key=ep.snapshot_key,
                session_id=ep.session_id or ep.id,
            ),
            weights=dict(spec.rewards),
            turns_used=ep.turn + 1,
            max_turns=env.max_turns,
            format_ok=format_ok,
        )
        self._issue(session, ep, "reward", request)
        transition_episode(session, ep, E.scoring)

    async def on_reward(self, msg: RewardResult) -> None:
        # Read first and write the trajectory and log outside the transaction (object storage is slow
        # and idempotent: the key is fixed per episode), then commit the state change.
        async with self.tx() as session:
            awaited = await self._awaited(session, msg, "reward", E.scoring, msg.error)
            if awaited is None:
                return
            # Declared optional: the second transaction below re-reads them, and may not find them.
            ep: Episode | None
            step: Step | None
            ep, step = awaited
            steps = list(
                (
                    await session.execute(
                        select(Step).where(Step.episode_id == ep.id).order_by(Step.turn, Step.id)
                    )
                ).scalars()
            )
            tok = self.tok_of(await self.spec_of(session, ep.job_id))
            trajectory = build_trajectory(ep, steps, msg, tok, finished_at=utcnow())
            key = object_key(ep.tenant_id, ep.job_id, "trajectories", f"{ep.id}.json")
            episode_log = build_episode_log(ep, steps, msg)
            episode_log_key = log_key(ep.tenant_id, ep.job_id, ep.id)
        # The log beside it, in one write: every step's sandbox output, timings and reward.
        await asyncio.gather(
            self.store.put(key, trajectory.model_dump_json().encode(), "application/json"),
            self.store.put(episode_log_key, episode_log, "application/x-ndjson"),
        )
        async with self.tx() as session:
            ep, step = await self._lock_with_step(session, msg.episode_id, msg.turn or 0, "reward")
            why = self._is_current(ep, step, msg, E.scoring)
            if why:
                return self._ignore(why, msg)
            assert ep is not None and step is not None
            components = {k: v.model_dump(mode="json") for k, v in msg.components.items()}
            complete_step(step, {"reward": msg.reward, "components": components})
            self._observe_step(step)
            ep.reward = msg.reward
            ep.rewards = components
            ep.trajectory_key = key
            ep.timings = {**ep.timings, **trajectory.timings}
            transition_episode(session, ep, E.scored)
            enqueue(
                session,
                Topics.EVENTS,
                LifecycleEvent(
                    event="episode.reward",
                    job_id=ep.job_id,
                    episode_id=ep.id,
                    turn=ep.turn,
                    tenant=ep.tenant_id,
                    reward=msg.reward,
                    data={
                        "iteration": ep.iteration,
                        "task_id": ep.task_id,
                        "group_id": ep.group_id,
                        "components": {k: v.value for k, v in msg.components.items()},
                        "turns": ep.turn + 1,
                    },
                ),
            )
            enqueue(
                session,
                Topics.TRAJECTORIES,
                TrajectoryReady(
                    job_id=ep.job_id,
                    episode_id=ep.id,
                    task_id=ep.task_id,
                    group_id=ep.group_id,
                    trajectory_key=key,
                    behaviour_version=trajectory.behaviour_version,
                    reward=msg.reward,
                ),
            )
            # The task's outcome: this transaction is its only writer, once per scored episode.
            ok = passed(msg)
            record_outcome(
                session,
                episode_id=ep.id,
                task_id=ep.task_id,
                job_id=ep.job_id,
                policy_version=ep.behaviour_version,
                passed=ok,
                reward=msg.reward,
            )
            log_event(log, "episode scored", reward=msg.reward, passed=ok, turns=ep.turn + 1)

    @staticmethod
    def _observe_step(step: Step | StepRow) -> None:
        if step.created_at is not None and step.completed_at is not None:
            seconds = (step.completed_at - step.created_at).total_seconds()
            metrics.TURN_SECONDS.labels(step.kind).observe(max(0.0, seconds))

    # --- leases --------------------------------------------------------------------------------
    async def reap_expired(self, limit: int = 200) -> int:
        """Retry (or fail) every step whose lease expired; returns how many. The only lease
        reaper (docs/operations.md says why): it alone counts expired leases."""
        async with self.tx() as session:
            query = (
                select(Episode)
                .where(
                    Episode.state.in_([s.value for s in STEP_FOR_STATE]), Episode.lease_expires_at < utcnow()
                )
                .order_by(Episode.lease_expires_at)
                .limit(limit)
            )
            if not self.db.is_sqlite:
                query = query.with_for_update(skip_locked=True)
            expired = list((await session.execute(query)).scalars())
            metrics.EPISODES_STUCK.set(len(expired))
            for ep in expired:
                kind = STEP_FOR_STATE[EpisodeState(ep.state)]
                step = await self._step(session, ep.id, ep.turn, kind)
                with log_context(job_id=ep.job_id, episode_id=ep.id, turn=ep.turn):
                    metrics.STEP_LEASES_EXPIRED.labels(kind).inc()
                    if step is None:  # cannot happen unless rows were edited by hand
                        transition_episode(session, ep, E.failed, reason=f"lease_expired: no {kind} step")
                        continue
                    self.retry_or_fail(session, ep, step, f"lease_expired: {kind} step of turn {ep.turn}")
            return len(expired)

    def describe(self) -> dict[str, Any]:
        return {"ignored_results": self.ignored}
