"""Retention: delete the objects of jobs that finished long ago.

A job's objects are its trajectories and episode logs and checkpoints
(``tenants/<t>/jobs/<j>/...``), its reward records (``rewards/<j>/...``) and its
episodes' sandbox snapshots (``<snapshot_prefix>/<session>/...``). Once the job
finished (``jobs.finished_at``) more than ``days`` ago, all of them go except the
checkpoint of the job's latest policy version (weights and optimizer state), which is
what a user would deploy or resume from, and the episodes' archived steps
(``tenants/<t>/jobs/<j>/steps/``, ``temper.episode_steps``). Database rows stay: the job
and its episodes remain readable, and a transcript or an episode's log falls back to the
steps (the rows, or their archive once the dispatcher moved them out of Postgres).

``TEMPER_RETENTION__DAYS`` turns it on; the Celery beat task ``temper.retention``
(the worker service, ``services/worker``) runs :func:`delete_expired` once a day.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime, timedelta

from sqlalchemy import func, select, update

from temper.clock import utcnow
from temper.db import Database, Episode, Job, PolicyVersion
from temper.logs import log_context, log_event
from temper.storage import ObjectStore, object_key

log = logging.getLogger("temper.retention")

KINDS = ("trajectories", "logs", "checkpoints", "snapshots", "rewards", "other")
# The steps of finished episodes, archived out of Postgres (temper.episode_steps): kept, as
# the rows were before, so a transcript can still be read once the trajectory is gone.
KEPT_STEPS = "steps"


def _stem(checkpoint_key: str) -> str:
    """The prefix every file of a version shares: ``.../versions/v3/manifest.json`` ->
    ``.../versions/v3/`` (the registry); ``.../v3.safetensors`` -> ``.../v3.`` (before it)."""
    if checkpoint_key.endswith("/manifest.json"):
        return checkpoint_key[: -len("manifest.json")]
    return checkpoint_key.rsplit(".safetensors", 1)[0] + "."


async def delete_expired(
    store: ObjectStore,
    db: Database,
    now: datetime | None = None,
    days: float | None = None,
    *,
    snapshot_prefix: str = "sandbox-snapshots",
) -> dict[str, int]:
    """Delete the objects of every job that finished more than ``days`` ago (``None``:
    retention is off, nothing is deleted). Returns how many objects of each kind went,
    plus ``jobs``, the number of expired jobs looked at."""
    counts: Counter[str] = Counter({k: 0 for k in (*KINDS, "jobs")})
    if days is None:
        return dict(counts)
    if days <= 0:
        raise ValueError("retention days must be positive")
    cutoff = (now or utcnow()) - timedelta(days=days)
    async with db.session() as s:
        finished = (
            await s.execute(
                select(Job.id, Job.tenant_id, Job.finished_at).where(Job.finished_at.is_not(None))
            )
        ).all()
    expired = [(job_id, tenant) for job_id, tenant, at in finished if at is not None and at < cutoff]
    for job_id, tenant in expired:
        with log_context(job_id=job_id, tenant=tenant):
            job_counts = await _delete_job(store, db, tenant, job_id, snapshot_prefix)
        counts.update(job_counts)
        counts["jobs"] += 1
        if any(job_counts.values()):
            log_event(log, "retention deleted job objects", job_id=job_id, tenant=tenant, **job_counts)
    result = dict(counts)
    log_event(
        log,
        "retention pass",
        days=days,
        cutoff=cutoff.isoformat(),
        deleted=sum(result[k] for k in KINDS),
        **result,
    )
    return result


async def _delete_job(
    store: ObjectStore, db: Database, tenant: str, job_id: str, snapshot_prefix: str
) -> Counter[str]:
    counts: Counter[str] = Counter()
    async with db.session() as s:
        latest = await s.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.job_id == job_id))
        keep_key = None
        if latest is not None:
            keep_key = await s.scalar(
                select(PolicyVersion.checkpoint_key).where(
                    PolicyVersion.job_id == job_id, PolicyVersion.version == latest
                )
            )
        sessions = list(
            (
                await s.execute(
                    select(Episode.id, Episode.session_id).where(
                        Episode.job_id == job_id, Episode.snapshot_key.is_not(None)
                    )
                )
            ).all()
        )
    keep = _stem(keep_key) if keep_key else None

    prefix = object_key(tenant, job_id) + "/"
    for key in await store.list(prefix):
        kind = key[len(prefix) :].split("/", 1)[0]
        if kind == "versions":  # the registry's policy versions are the job's checkpoints
            kind = "checkpoints"
        if kind == "checkpoints" and keep is not None and key.startswith(keep):
            continue
        if kind == KEPT_STEPS:  # archived steps stay as long as their episodes' rows
            continue
        await store.delete(key)
        counts[kind if kind in KINDS else "other"] += 1

    for key in await store.list(f"rewards/{job_id}/"):
        await store.delete(key)
        counts["rewards"] += 1

    for episode_id, session_id in sessions:
        for key in await store.list(f"{snapshot_prefix}/{session_id or episode_id}/"):
            await store.delete(key)
            counts["snapshots"] += 1
    if sessions:
        # The snapshots are gone: stop pointing at them (and skip these episodes next time).
        async with db.session() as s:
            await s.execute(
                update(Episode)
                .where(Episode.job_id == job_id, Episode.snapshot_key.is_not(None))
                .values(snapshot_key=None)
            )
    return counts
