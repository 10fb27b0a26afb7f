"""The worker's process: a Celery app on the batch queue (:mod:`temper.batch`) running
the tasks of ``handlers.py``, and their schedule under ``celery beat``:

- ``temper.validate_taskset(taskset_id)`` runs the validation pipeline, reporting
  progress as task state ``PROGRESS`` with ``{"current", "total"}``;
- ``temper.retention()`` runs daily and deletes the objects of jobs finished more than
  ``TEMPER_RETENTION__DAYS`` ago (:func:`temper.retention.delete_expired`).

Start a worker with ``python -m services.worker`` (``celery -A services.worker.app
worker``) and the schedule with ``python -m services.worker beat``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from celery import Celery

from services.worker import handlers
from temper import batch
from temper.settings import Settings, get_settings

RETENTION_INTERVAL_S = 24 * 3600.0


def create_app(settings: Settings) -> Celery:
    app = batch.make_celery(
        settings.redis.url,
        beat_schedule={
            "delete-expired-objects": {"task": batch.RETENTION, "schedule": RETENTION_INTERVAL_S},
        },
    )

    @app.task(name=batch.VALIDATE_TASKSET, bind=True)
    def validate_taskset(self: Any, taskset_id: str) -> dict[str, Any]:
        def progress(current: int, total: int) -> None:
            self.update_state(
                state="PROGRESS", meta={"current": current, "total": total, "taskset_id": taskset_id}
            )

        return asyncio.run(handlers.validate_taskset(get_settings(), taskset_id, progress))

    @app.task(name=batch.RETENTION)
    def retention() -> dict[str, Any]:
        return asyncio.run(handlers.retention(get_settings()))

    return app


app = create_app(get_settings())
