"""Step leases: how long a step may wait, its retry with the next attempt or the
episode's failure once attempts run out, and the reaper that applies both to expired
leases. The reaper is the only one (docs/operations.md says why): it alone counts
expired leases."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta

from services.dispatcher import repo
from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Step, rows
from temper.db.core import CoreTx
from temper.events import InferenceRequest, Message, RewardRequest, SandboxRequest, Topics
from temper.lifecycle import EpisodeState, fail_step, retry_step, transition_episode
from temper.logs import log_context, log_event
from temper.outbox import enqueue
from temper.settings import DispatcherSettings

log = logging.getLogger("temper.dispatcher.leases")

E = EpisodeState
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


def past_deadline(ep: Episode) -> bool:
    """The episode's ``max_episode_s`` deadline has passed (``services.dispatcher.deadlines``)."""
    return ep.deadline_at is not None and utcnow() >= ep.deadline_at


def lease_until(settings: DispatcherSettings, kind: str, extra_s: float = 0.0) -> datetime:
    lease = settings.lease_s
    if kind == "reward" and settings.reward_lease_s:
        lease = settings.reward_lease_s
    return utcnow() + timedelta(seconds=lease + extra_s)


async def retry_or_fail(
    tx: CoreTx, settings: DispatcherSettings, ep: Episode, step: Step, reason: str
) -> bool:
    """Re-send ``step`` with the next attempt, or fail the episode once attempts run out
    (both written by the caller's ``rows.write``). Returns True when it retried."""
    if step.attempt + 1 < settings.max_step_attempts:
        if "request" not in rows.loaded_columns(step):  # the hot path's query leaves it out
            await rows.load(tx, step, "request")
        retry_step(step, lease_expires_at=lease_until(settings, step.kind))
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
        enqueue(tx, TOPIC_FOR_KIND[step.kind], message)
        log_event(log, "step retried", logging.WARNING, kind=step.kind, attempt=step.attempt, reason=reason)
        return True
    fail_step(step)
    transition_episode(tx, ep, E.failed, reason=f"{reason} (after {step.attempt + 1} attempts)")
    log_event(log, "episode failed", logging.WARNING, reason=reason, attempts=step.attempt + 1)
    return False


OnDeadline = Callable[[CoreTx, Episode, Step], Awaitable[Step]]


async def reap_expired(
    transaction: Callable[[], AbstractAsyncContextManager[CoreTx]],
    settings: DispatcherSettings,
    limit: int = 200,
    *,
    on_deadline: OnDeadline | None = None,
) -> int:
    """Retry (or fail) every step whose lease expired, in one transaction; returns how
    many. A step of an episode past its deadline (its lease ends there) is not retried:
    ``on_deadline`` ends the episode and returns the step it issues. Another replica's
    reaper skips the episodes this one locked."""
    async with transaction() as tx:
        ids = await repo.expired_episodes(tx, utcnow(), limit)
        metrics.EPISODES_STUCK.set(len(ids))
        locked = await repo.lock_episodes(tx, sorted(ids), None)
        touched: list[Episode | Step | None] = []
        for ep, step, _, _ in locked.values():
            kind = repo.KIND_OF_STATE[EpisodeState(ep.state)]
            touched += [ep, step]
            with log_context(job_id=ep.job_id, episode_id=ep.id, turn=ep.turn):
                metrics.STEP_LEASES_EXPIRED.labels(kind).inc()
                if step is None:  # cannot happen unless rows were edited by hand
                    transition_episode(tx, ep, E.failed, reason=f"lease_expired: no {kind} step")
                    continue
                if on_deadline is not None and kind != "reward" and past_deadline(ep):
                    touched.append(await on_deadline(tx, ep, step))
                    continue
                await retry_or_fail(tx, settings, ep, step, f"lease_expired: {kind} step of turn {ep.turn}")
        await rows.write(tx, touched)
        return len(ids)
