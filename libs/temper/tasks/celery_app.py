"""The Celery app (``temper.tasks.app``): batch and periodic work that is not a stream.

- ``temper.validate_taskset(taskset_id)`` runs the validation pipeline, reporting
  progress as task state ``PROGRESS`` with ``{"current", "total"}``;
- ``temper.retention()`` runs daily under ``celery beat`` and deletes the objects of jobs
  finished more than ``TEMPER_RETENTION__DAYS`` ago (:func:`temper.retention.delete_expired`).

Broker and result backend are ``TEMPER_REDIS__URL``. Start a worker with
``celery -A temper.tasks worker`` and the schedule with ``celery -A temper.tasks beat``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from celery import Celery

from temper.settings import get_settings

RETENTION_INTERVAL_S = 24 * 3600.0


def make_app(redis_url: str | None = None) -> Celery:
    url = redis_url or get_settings().redis.url
    app = Celery("temper", broker=url, backend=url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_track_started=True,
        task_acks_late=True,  # a worker that dies mid-validation leaves the task to another
        worker_prefetch_multiplier=1,
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
        beat_schedule={
            "delete-expired-objects": {"task": "temper.retention", "schedule": RETENTION_INTERVAL_S},
        },
    )
    return app


app = make_app()


async def _validate(taskset_id: str, progress: Any) -> dict[str, int]:
    from temper.db import Database
    from temper.rewards.runner import TestRunner, scoring_sandbox_settings
    from temper.sandbox import SandboxManager
    from temper.tasks.validation import validate_taskset

    settings = get_settings()
    db = Database(settings.db)
    manager = SandboxManager(
        scoring_sandbox_settings(settings.sandbox), distributed=settings.mode == "distributed"
    )
    await manager.start()
    try:
        return await validate_taskset(db, TestRunner(manager), taskset_id, progress=progress)
    finally:
        await manager.close()
        await db.dispose()


@app.task(name="temper.validate_taskset", bind=True)
def validate_taskset_task(self: Any, taskset_id: str) -> dict[str, Any]:
    def progress(current: int, total: int) -> None:
        self.update_state(
            state="PROGRESS", meta={"current": current, "total": total, "taskset_id": taskset_id}
        )

    counts = asyncio.run(_validate(taskset_id, progress))
    return {
        "taskset_id": taskset_id,
        "counts": counts,
        "current": sum(counts.values()),
        "total": sum(counts.values()),
    }


async def _retention() -> dict[str, Any]:
    from temper.db import Database
    from temper.retention import delete_expired
    from temper.storage import make_store

    settings = get_settings()
    days = settings.retention.days
    if days is None:
        return {"days": None, "jobs": 0}  # retention is off
    db = Database(settings.db)
    try:
        counts = await delete_expired(
            make_store(settings), db, days=days, snapshot_prefix=settings.sandbox.snapshot_prefix
        )
    finally:
        await db.dispose()
    return {"days": days, **counts}


@app.task(name="temper.retention")
def retention_task() -> dict[str, Any]:
    return asyncio.run(_retention())
