"""The worker's process: a Celery app on the Celery queue (:mod:`temper.celery_queue`)
running the Celery tasks of ``celery_tasks.py``, and their schedule under ``celery beat``:

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

from services.worker import celery_tasks
from temper import celery_queue
from temper.settings import Settings, get_settings

RETENTION_INTERVAL_S = 24 * 3600.0


def create_app(settings: Settings) -> Celery:
    app = celery_queue.make_celery(
        settings.redis.url,
        beat_schedule={
            "delete-expired-objects": {"task": celery_queue.RETENTION, "schedule": RETENTION_INTERVAL_S},
        },
    )

    @app.task(name=celery_queue.VALIDATE_TASKSET, bind=True)
    def validate_taskset(self: Any, taskset_id: str) -> dict[str, Any]:
        def progress(current: int, total: int) -> None:
            self.update_state(
                state="PROGRESS", meta={"current": current, "total": total, "taskset_id": taskset_id}
            )

        return asyncio.run(celery_tasks.validate_taskset(settings, taskset_id, progress))

    @app.task(name=celery_queue.RETENTION)
    def retention() -> dict[str, Any]:
        return asyncio.run(celery_tasks.retention(settings))

    return app


app = create_app(get_settings())
