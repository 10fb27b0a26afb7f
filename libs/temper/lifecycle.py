"""Job and episode lifecycles as explicit transition tables. No other code writes a
``state`` column: every change goes through :func:`transition_job` or
:func:`transition_episode`, inside the caller's transaction, and emits a lifecycle
event on ``events`` through the outbox in that same transaction."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy.ext.asyncio import AsyncSession

from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Job
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


J, E = JobState, EpisodeState

# to-state -> the states it may be entered from
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    J.running: frozenset({J.pending, J.paused}),
    J.paused: frozenset({J.running}),
    J.completed: frozenset({J.running}),
    J.failed: frozenset({J.pending, J.running, J.paused}),
    J.cancelled: frozenset({J.pending, J.running, J.paused}),
}
EPISODE_TRANSITIONS: dict[EpisodeState, frozenset[EpisodeState]] = {
    # from awaiting_action itself: a malformed action is answered with an observation, no sandbox step
    E.awaiting_action: frozenset({E.pending, E.acting, E.awaiting_action}),
    E.acting: frozenset({E.awaiting_action}),
    E.scoring: frozenset({E.awaiting_action, E.acting}),
    E.scored: frozenset({E.scoring}),
    E.trained: frozenset({E.scored}),
    E.failed: frozenset({E.pending, E.awaiting_action, E.acting, E.scoring}),
    E.cancelled: frozenset({E.pending, E.awaiting_action, E.acting, E.scoring}),
}
JOB_TERMINAL = frozenset({J.completed, J.failed, J.cancelled})
EPISODE_FINISHED = frozenset({E.scored, E.trained, E.failed, E.cancelled})


class IllegalTransition(ValueError):
    pass


def transition_job(session: AsyncSession, job: Job, to: JobState, *, reason: str | None = None) -> None:
    current = JobState(job.state)
    if current not in JOB_TRANSITIONS[to]:
        raise IllegalTransition(f"job {job.id}: {current} -> {to} is not allowed")
    job.state = to
    job.state_reason = reason
    job.updated_at = utcnow()
    if to in JOB_TERMINAL:
        job.finished_at = utcnow()
    enqueue(
        session,
        Topics.EVENTS,
        LifecycleEvent(event="job.state", job_id=job.id, tenant=job.tenant_id, state=to, reason=reason),
    )


def transition_episode(
    session: AsyncSession, episode: Episode, to: EpisodeState, *, reason: str | None = None
) -> None:
    current = EpisodeState(episode.state)
    if current not in EPISODE_TRANSITIONS[to]:
        raise IllegalTransition(f"episode {episode.id}: {current} -> {to} is not allowed")
    episode.state = to
    episode.state_reason = reason
    episode.updated_at = utcnow()
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
