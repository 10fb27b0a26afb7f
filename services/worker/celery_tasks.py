"""The Celery tasks the worker runs, one function per task name (see :mod:`temper.celery_queue`).
Each opens what it needs from the settings (database, sandboxes, object store), calls
the library function that does the work, and closes it again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temper.db import Database
from temper.retention import delete_expired
from temper.rewards import Scorer
from temper.rewards.runner import scoring_sandbox_settings
from temper.sandbox import SandboxManager
from temper.settings import Settings
from temper.storage import make_store
from temper.tasks.validation import validate_taskset as validate

Progress = Callable[[int, int], None]


async def validate_taskset(settings: Settings, taskset_id: str, progress: Progress) -> dict[str, Any]:
    """Run every task of the set through its hidden tests and its oracle in sandboxes."""
    db = Database(settings.db)
    manager = SandboxManager(
        scoring_sandbox_settings(settings.sandbox),
        distributed=settings.mode == "distributed",
        store=make_store(settings),  # task images are pulled from it
    )
    await manager.start()
    try:
        counts = await validate(db, Scorer(manager), taskset_id, progress=progress)
    finally:
        await manager.close()
        await db.dispose()
    return {
        "taskset_id": taskset_id,
        "counts": counts,
        "current": sum(counts.values()),
        "total": sum(counts.values()),
    }


async def retention(settings: Settings) -> dict[str, Any]:
    """Delete the objects of jobs finished more than ``TEMPER_RETENTION__DAYS`` ago."""
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
