"""Expired step leases, for the periodic Celery task ``temper.reap_leases``.

A step (one command of a turn) holds a lease while it waits for its result. This
module only *marks* the steps whose lease ran out: ``state`` goes from ``leased`` to
``expired`` and the ``temper_step_leases_expired_total`` counter counts them. What
happens next — retry with a new attempt, or fail the episode — is the dispatcher's
decision, made by its own reaper, which stays authoritative.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select, update

from temper import metrics
from temper.db import Database, Step

EXPIRED = "expired"


async def reap_expired(
    db: Database, *, now: datetime | None = None, limit: int = 1000
) -> list[tuple[str, int, str]]:
    """Mark leased steps whose lease has passed; returns (episode, turn, kind) of each."""
    now = now or datetime.now(UTC)
    async with db.session() as session:
        rows = (
            await session.execute(
                select(Step.id, Step.episode_id, Step.turn, Step.kind)
                .where(
                    Step.state == "leased", Step.lease_expires_at.is_not(None), Step.lease_expires_at < now
                )
                .limit(limit)
            )
        ).all()
        if not rows:
            return []
        ids = [r.id for r in rows]
        # the state guard makes a step that completed meanwhile stay completed
        await session.execute(
            update(Step).where(Step.id.in_(ids), Step.state == "leased").values(state=EXPIRED)
        )
    for r in rows:
        metrics.STEP_LEASES_EXPIRED.labels(kind=r.kind).inc()
    return [(r.episode_id, r.turn, r.kind) for r in rows]
