"""Task sets (the RL tasks): the task format, importers (HumanEval, GSM8K-style math),
storage in the database and object store, the REST routes and the validation pipeline,
which the worker service (``services/worker``) runs as a batch task."""

from __future__ import annotations

from temper.tasks.models import TaskFormatError, TaskKind, TaskSpec, TaskStatus, parse_tasks

__all__ = ["TaskFormatError", "TaskKind", "TaskSpec", "TaskStatus", "parse_tasks"]
