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

The episode and step functions take the one row type of each table, the mapped
:class:`temper.db.Episode` and :class:`temper.db.Step`. The dispatcher reads and writes
them with SQLAlchemy Core (``temper.db.rows``: detached instances whose changes are
written in the caller's transaction); an ORM session's instances follow the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Select, bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Job, Step, rows
from temper.db.core import SessionTx
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
    E.acting: _rule(E.pending, E.awaiting_action),  # pending: an agent episode starts by running its agent
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


EPISODE_COLUMNS = rows.columns(Episode)
STEP_COLUMNS = rows.columns(Step)


def _unfinished_with_waiting_step() -> Select[Any]:
    """A job's unfinished episodes (locked, in id order, as the dispatcher's batches take
    them, so the two cannot deadlock), each with its waiting step if it has one."""
    ep = Episode.__table__.c
    finished = [s.value for s in EPISODE_FINISHED]
    waiting = [s.value for s in STEP_WAITING]
    step_table = Step.__table__.alias("step")
    step = step_table.c
    joined = Episode.__table__.outerjoin(step_table, (step.episode_id == ep.id) & step.state.in_(waiting))
    return (
        select(*(ep[c] for c in EPISODE_COLUMNS), *(step[c] for c in STEP_COLUMNS))
        .select_from(joined)
        .where(ep.job_id == bindparam("job_id"), ep.state.not_in(finished))
        .order_by(ep.id)
    )


_UNFINISHED = _unfinished_with_waiting_step()


async def _cancel_unfinished(session: AsyncSession, job_id: str, *, reason: str) -> None:
    await session.flush()  # rows this session changed or staged, before the read
    await rows.write_staged(session)
    conn = await session.connection()
    query = (
        _UNFINISHED if conn.dialect.name == "sqlite" else _UNFINISHED.with_for_update(of=Episode.__table__)
    )
    episodes: dict[str, Episode] = {}
    changed: list[Episode | Step] = []
    n = len(EPISODE_COLUMNS)
    for row in await conn.execute(query, {"job_id": job_id}):
        values = tuple(row)
        ep = episodes.get(values[0])
        if ep is None:
            ep = episodes[values[0]] = rows.loaded(
                Episode, dict(zip(EPISODE_COLUMNS, values[:n], strict=True))
            )
            changed.append(ep)
        step = rows.loaded_from(Step, STEP_COLUMNS, values[n:])
        if step is not None:
            cancel_step(step)
            changed.append(step)
    for episode in episodes.values():
        transition_episode(session, episode, E.cancelled, reason=reason)
    await rows.write(SessionTx(conn, session.info), changed)
    for obj in list(session.identity_map.values()):  # what the session held of them is stale now
        if isinstance(obj, Episode | Step):
            session.expire(obj)


# --- episodes --------------------------------------------------------------------------------


def transition_episode(
    session: rows.HasInfo, episode: Episode, to: EpisodeState, *, reason: str | None = None
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


def new_step(
    *, episode_id: str, turn: int, kind: str, request: dict[str, Any], lease_expires_at: datetime
) -> Step:
    """A step whose command is going out now (attempt 0), leased until ``lease_expires_at``:
    a new row, for the caller's session or ``temper.db.rows.write``."""
    return rows.new(
        Step,
        episode_id=episode_id,
        turn=turn,
        kind=kind,
        attempt=0,
        state=S.leased,
        request=request,
        result=None,
        lease_expires_at=lease_expires_at,
        created_at=utcnow(),
        completed_at=None,
    )


def _transition_step(step: Step, to: StepState) -> None:
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


def retry_step(step: Step, *, lease_expires_at: datetime) -> None:
    """The same step again with the next attempt, leased anew."""
    _transition_step(step, S.leased)
    step.attempt += 1
    step.lease_expires_at = lease_expires_at


def complete_step(step: Step, result: dict[str, Any]) -> None:
    _transition_step(step, S.done)
    step.result = result


def fail_step(step: Step) -> None:
    _transition_step(step, S.failed)


def cancel_step(step: Step) -> None:
    _transition_step(step, S.cancelled)
