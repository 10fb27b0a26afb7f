"""Task sets: the task format, importers (HumanEval, GSM8K-style math), storage in the
database and object store, the REST routes and the Celery validation pipeline. The
Celery app is ``temper.tasks.app`` (``celery -A temper.tasks worker``)."""

from __future__ import annotations

from typing import Any

from temper.tasks.models import TaskFormatError, TaskKind, TaskSpec, TaskStatus, parse_tasks

__all__ = ["TaskFormatError", "TaskKind", "TaskSpec", "TaskStatus", "app", "parse_tasks"]


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from services.worker.app import app

        return app
    raise AttributeError(name)
