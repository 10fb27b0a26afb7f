"""The Celery queue (on Redis, ``TEMPER_REDIS__URL``): the names of the Celery tasks (the
background work that is not a stream: task-set validation, retention) and a client to
queue them. The worker that runs them is a service,
``services/worker`` (``python -m services.worker``); the library only sends by name.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

VALIDATE_TASKSET = "temper.validate_taskset"  # validate a task set, reporting PROGRESS
RETENTION = "temper.retention"  # delete the objects of long-finished jobs (periodic)


def make_celery(redis_url: str, **conf: Any) -> Celery:
    """A Celery app on the queue, configured as both ends expect (JSON only, acks after the
    task, one task prefetched); ``conf`` adds to that configuration."""
    app = Celery("temper", broker=redis_url, backend=redis_url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_track_started=True,
        task_acks_late=True,  # a worker that dies mid-validation leaves the task to another
        worker_prefetch_multiplier=1,
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


def enqueue(name: str, *args: Any, redis_url: str) -> str:
    """Queue the Celery task ``name``; returns its Celery task id."""
    app = make_celery(redis_url)
    try:
        return str(app.send_task(name, args=list(args)).id)
    finally:
        app.close()
