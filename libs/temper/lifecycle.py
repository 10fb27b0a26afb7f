"""Job, episode and step lifecycles as explicit transition tables. No other code writes
a ``state`` column: every change goes through :func:`transition_job`,
:func:`transition_episode` or one of the step functions (:func:`new_step`,
:func:`retry_step`, :func:`complete_step`, :func:`fail_step`, :func:`cancel_step`),
inside the caller's transaction. Job and episode changes emit a lifecycle event on
``events`` through the outbox in that same transaction.

Each table maps a to-state to its :class:`Rule`: the states it may be entered from and
whether it needs a reason. The side effects of a transition live here, once:

- leaving a waiting state (an episode waiting on a step, a step waiting on its result)
  for a state that waits on nothing clears ``lease_expires_at``;
- a job that fails or is cancelled takes its unfinished episodes with it (``cancelled``,
  reason ``job failed`` / ``job cancelled``) and their waiting steps (``cancelled``), so a
  result that arrives later finds nothing waiting and is ignored.

The episode and step functions take ORM objects or, on the dispatcher's hot path, the
Core-level :class:`EpisodeRow` and :class:`StepRow` (rows read with SQLAlchemy Core that
remember which columns were set); :func:`write_rows` writes those, and the steps that
:func:`new_step_values` made, in the caller's transaction. Either way the rules here
decide every ``state`` value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, cast

from sqlalchemy import Table, bindparam, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.sql.dml import Insert, Update

from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Job, Step
from temper.events import LifecycleEvent, Topics
from temper.outbox import enqueue


class JobState(StrEnum):
    pending = "pending"
    running = "running"
    paused = "paused"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


class EpisodeState(StrEnum):
    pending = "pending"
    awaiting_action = "awaiting_action"  # the model is being asked for the next action
    acting = "acting"  # the sandbox is executing the action
    scoring = "scoring"
    scored = "scored"
    trained = "trained"
    failed = "failed"
    cancelled = "cancelled"


class StepState(StrEnum):
    leased = "leased"  # its command is out; the result is awaited until lease_expires_at
    done = "done"
    failed = "failed"  # its attempts ran out (the episode failed with it)
    cancelled = "cancelled"  # its job failed or was cancelled while it waited


@dataclass(frozen=True)
class Rule:
    sources: frozenset[Any]
    needs_reason: bool = False


def _rule(*sources: StrEnum, needs_reason: bool = False) -> Rule:
    return Rule(frozenset(sources), needs_reason)


J, E, S = JobState, EpisodeState, StepState

# to-state -> the rule for entering it
JOB_TRANSITIONS: dict[JobState, Rule] = {
    # from failed or cancelled: resumed, the same job going on from its last published
    # policy version (the trainer reloads it with its optimizer state); the episodes it
    # already finished still count, its unfinished ones stay cancelled
    J.running: _rule(J.pending, J.paused, J.failed, J.cancelled),
    J.paused: _rule(J.running),
    J.completed: _rule(J.running),
    J.failed: _rule(J.pending, J.running, J.paused, needs_reason=True),
    J.cancelled: _rule(J.pending, J.running, J.paused, needs_reason=True),
}
EPISODE_TRANSITIONS: dict[EpisodeState, Rule] = {
    # from awaiting_action itself: a malformed action is answered with an observation, no sandbox step
    E.awaiting_action: _rule(E.pending, E.acting, E.awaiting_action),
    E.acting: _rule(E.awaiting_action),
    E.scoring: _rule(E.awaiting_action, E.acting),
    E.scored: _rule(E.scoring),
    E.trained: _rule(E.scored),
    E.failed: _rule(E.pending, E.awaiting_action, E.acting, E.scoring, needs_reason=True),
    E.cancelled: _rule(E.pending, E.awaiting_action, E.acting, E.scoring, needs_reason=True),
}
STEP_TRANSITIONS: dict[StepState, Rule] = {
    S.leased: _rule(S.leased),  # a retry: the same step again with the next attempt
    S.done: _rule(S.leased),
    S.failed: _rule(S.leased),
    S.cancelled: _rule(S.leased),
}
JOB_TERMINAL = frozenset({J.completed, J.failed, J.cancelled})
JOB_ENDS_EPISODES = frozenset({J.failed, J.cancelled})
EPISODE_FINISHED = frozenset({E.scored, E.trained, E.failed, E.cancelled})
EPISODE_WAITING = frozenset({E.awaiting_action, E.acting, E.scoring})  # each waits on one leased step
STEP_WAITING = frozenset({S.leased})


class IllegalTransition(ValueError):
    pass


def _check(table: dict[Any, Rule], what: str, current: StrEnum, to: StrEnum, reason: str | None) -> None:
    rule = table.get(to)
    if rule is None or current not in rule.sources:
        raise IllegalTransition(f"{what}: {current} -> {to} is not allowed")
    if rule.needs_reason and not reason:
        raise IllegalTransition(f"{what}: {current} -> {to} needs a reason")


# --- jobs ------------------------------------------------------------------------------------


async def transition_job(session: AsyncSession, job: Job, to: JobState, *, reason: str | None = None) -> None:
    """Move ``job`` to ``to``; ``state_reason`` becomes ``reason`` (required for failed and
    cancelled). A failed or cancelled job cancels its unfinished episodes and their steps."""
    current = JobState(job.state)
    _check(JOB_TRANSITIONS, f"job {job.id}", current, to, reason)
    job.state = to
    job.state_reason = reason
    job.updated_at = utcnow()
    job.finished_at = utcnow() if to in JOB_TERMINAL else None  # a resumed job is not finished
    enqueue(
        session,
        Topics.EVENTS,
        LifecycleEvent(event="job.state", job_id=job.id, tenant=job.tenant_id, state=to, reason=reason),
    )
    if to in JOB_ENDS_EPISODES:
        await _cancel_unfinished(session, job.id, reason=f"job {to}")


STUCK_PREFIX = "stuck: "


async def mark_job_stuck(session: AsyncSession, job_id: str, why: str | None) -> None:
    """A job that keeps its state but cannot move says why in its reason (``stuck: why``);
    ``None`` clears it. A reason its state was entered with (failed, cancelled) is never
    overwritten. This and :func:`transition_job` are the only writers of ``state_reason``."""
    ours = or_(Job.state_reason.is_(None), Job.state_reason.startswith(STUCK_PREFIX))
    reason = None if why is None else (STUCK_PREFIX + why)[:500]
    await session.execute(update(Job).where(Job.id == job_id, ours).values(state_reason=reason))


async def _cancel_unfinished(session: AsyncSession, job_id: str, *, reason: str) -> None:
    unfinished = (Episode.job_id == job_id, Episode.state.not_in([s.value for s in EPISODE_FINISHED]))
    # in id order, as the dispatcher's batches take them, so the two cannot deadlock
    query = select(Episode).where(*unfinished).order_by(Episode.id).with_for_update()
    episodes = list((await session.execute(query)).scalars())
    if not episodes:
        return
    steps = await session.execute(
        select(Step)
        .join(Episode, Episode.id == Step.episode_id)
        .where(*unfinished, Step.state.in_([s.value for s in STEP_WAITING]))
    )
    for step in steps.scalars():
        cancel_step(step)
    for episode in episodes:
        transition_episode(session, episode, E.cancelled, reason=reason)


# --- episodes --------------------------------------------------------------------------------


def transition_episode(
    session: AsyncSession, episode: Episode | EpisodeRow, to: EpisodeState, *, reason: str | None = None
) -> None:
    """Move ``episode`` to ``to`` (a reason is required for failed and cancelled); leaving
    the waiting states clears its lease."""
    current = EpisodeState(episode.state)
    _check(EPISODE_TRANSITIONS, f"episode {episode.id}", current, to, reason)
    episode.state = to
    episode.state_reason = reason
    episode.updated_at = utcnow()
    if to not in EPISODE_WAITING:
        episode.lease_expires_at = None
    metrics.EPISODE_TRANSITIONS.labels(to).inc()
    if to is E.failed:
        metrics.EPISODE_FAILURES.labels((reason or "unknown").split(":", 1)[0]).inc()
    enqueue(
        session,
        Topics.EVENTS,
        LifecycleEvent(
            event="episode.state",
            job_id=episode.job_id,
            episode_id=episode.id,
            turn=episode.turn,
            tenant=episode.tenant_id,
            state=to,
            reason=reason,
            reward=episode.reward if to is E.scored else None,
        ),
    )


# --- steps -----------------------------------------------------------------------------------


def new_step_values(
    *, episode_id: str, turn: int, kind: str, request: dict[str, Any], lease_expires_at: datetime
) -> dict[str, Any]:
    """The columns of a step whose command is going out now (attempt 0), leased until
    ``lease_expires_at``: for :func:`new_step`, or for :func:`write_rows` to insert."""
    return {
        "episode_id": episode_id,
        "turn": turn,
        "kind": kind,
        "attempt": 0,
        "state": S.leased,
        "request": request,
        "lease_expires_at": lease_expires_at,
        "created_at": utcnow(),
    }


def new_step(
    *, episode_id: str, turn: int, kind: str, request: dict[str, Any], lease_expires_at: datetime
) -> Step:
    """A step whose command is going out now (attempt 0), leased until ``lease_expires_at``."""
    return Step(
        **new_step_values(
            episode_id=episode_id, turn=turn, kind=kind, request=request, lease_expires_at=lease_expires_at
        )
    )


def _transition_step(step: Step | StepRow, to: StepState) -> None:
    _check(
        STEP_TRANSITIONS,
        f"step {step.kind} of episode {step.episode_id} turn {step.turn}",
        S(step.state),
        to,
        None,
    )
    step.state = to
    if to not in STEP_WAITING:
        step.lease_expires_at = None
        step.completed_at = utcnow()


def retry_step(step: Step | StepRow, *, lease_expires_at: datetime) -> None:
    """The same step again with the next attempt, leased anew."""
    _transition_step(step, S.leased)
    step.attempt += 1
    step.lease_expires_at = lease_expires_at


def complete_step(step: Step | StepRow, result: dict[str, Any]) -> None:
    _transition_step(step, S.done)
    step.result = result


def fail_step(step: Step | StepRow) -> None:
    _transition_step(step, S.failed)


def cancel_step(step: Step | StepRow) -> None:
    _transition_step(step, S.cancelled)


# --- Core-level rows -------------------------------------------------------------------------


class _Row:
    """A row read with SQLAlchemy Core, as a plain object whose attributes are its columns.
    It remembers which columns were set since it was read, so :func:`write_rows` updates
    only those: the cost of the ORM's unit of work without its bookkeeping."""

    TABLE: ClassVar[Table]
    COLUMNS: ClassVar[tuple[str, ...]]
    _changed: set[str]

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_changed", set())
        self.__dict__.update(values)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__[name] = value
        self._changed.add(name)

    def changed(self) -> dict[str, Any]:
        """The columns set since the row was read (or last written), with their values."""
        return {name: self.__dict__[name] for name in self._changed}

    def _written(self) -> None:
        self._changed.clear()


class EpisodeRow(_Row):
    """An ``episodes`` row (every column of :class:`temper.db.Episode`), plus the steps
    issued for it in this transaction (``new_steps``, from :func:`new_step_values`), which
    :func:`write_rows` inserts."""

    TABLE = cast(Table, Episode.__table__)
    COLUMNS = tuple(c.key for c in Episode.__table__.columns)
    id: str
    job_id: str
    tenant_id: str
    task_id: str
    group_id: str
    iteration: int
    state: str
    state_reason: str | None
    turn: int
    attempt: int
    format_errors: int
    behaviour_version: int | None
    reward: float | None
    rewards: dict[str, Any]
    session_id: str | None
    snapshot_key: str | None
    trajectory_key: str | None
    lease_expires_at: datetime | None
    timings: dict[str, Any]
    sandbox_cpu_s: float
    sandbox_memory_gb_s: float
    inference_tokens: int
    created_at: datetime
    updated_at: datetime
    new_steps: list[dict[str, Any]]

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.__dict__["new_steps"] = []


class StepRow(_Row):
    """A ``steps`` row (every column of :class:`temper.db.Step`)."""

    TABLE = cast(Table, Step.__table__)
    COLUMNS = tuple(c.key for c in Step.__table__.columns)
    id: int
    episode_id: str
    turn: int
    kind: str
    attempt: int
    state: str
    request: dict[str, Any]
    result: dict[str, Any] | None
    lease_expires_at: datetime | None
    created_at: datetime
    completed_at: datetime | None


_UPDATES: dict[tuple[str, frozenset[str]], Update] = {}
_INSERT_STEPS: Insert = insert(Step)


def _update_of(table: Table, columns: Iterable[str]) -> Update:
    """``UPDATE table SET <columns> WHERE id = :row_id``, built once per set of columns (a
    statement object keeps its cache key, so executing it again compiles nothing)."""
    key = (table.name, frozenset(columns))
    stmt = _UPDATES.get(key)
    if stmt is None:
        stmt = (
            update(table)
            .where(table.c.id == bindparam("row_id"))
            .values({table.c[c]: bindparam(f"set_{c}", type_=table.c[c].type) for c in sorted(key[1])})
        )
        _UPDATES[key] = stmt
    return stmt


async def write_rows(conn: AsyncConnection, *rows: EpisodeRow | StepRow | None) -> None:
    """Write what changed on each row, and insert the steps each episode issued, in the
    caller's transaction (``conn`` is its connection: ``await session.connection()``).
    Rows that changed the same columns are updated by one statement (executemany), so a
    batch of results costs about as many statements as one."""
    new_steps: list[dict[str, Any]] = []
    updates: dict[tuple[Table, frozenset[str]], list[dict[str, Any]]] = {}
    for row in rows:
        if row is None:
            continue
        if isinstance(row, EpisodeRow) and row.new_steps:
            new_steps += row.new_steps
            row.new_steps.clear()
        changed = row.changed()
        changed.pop("new_steps", None)
        changed.pop("id", None)
        if changed:
            params = {f"set_{c}": v for c, v in changed.items()}
            params["row_id"] = row.id
            updates.setdefault((row.TABLE, frozenset(changed)), []).append(params)
        row._written()
    if new_steps:
        await conn.execute(_INSERT_STEPS, new_steps)
    for (table, columns), params_list in updates.items():
        await conn.execute(_update_of(table, columns), params_list)
