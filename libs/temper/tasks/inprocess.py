"""Task-set validation run in the API's own process (embedded mode: no Celery, no Redis).

The same pipeline the worker service runs (:func:`temper.tasks.validation.validate_taskset`)
as a background task on the API's :class:`temper.runtime.Runtime`, with its own scoring
sandboxes; the upload answers at once and ``GET /v1/tasksets/{id}`` shows the progress.
"""

from __future__ import annotations

import asyncio
import uuid

from temper.logs import get_logger, log_event
from temper.rewards import Scorer
from temper.rewards.runner import scoring_sandbox_settings
from temper.runtime import Runtime
from temper.sandbox import SandboxManager
from temper.tasks.validation import validate_taskset

log = get_logger("temper.tasks.inprocess")


class InProcessValidation:
    """``enqueue`` for the dispatcher's task-set routes (``services.dispatcher.api.tasksets``): validation as a task of the runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.running: dict[str, asyncio.Task[None]] = {}

    async def enqueue(self, taskset_id: str) -> str:
        previous = self.running.get(taskset_id)
        if previous is not None and not previous.done():
            return previous.get_name()  # already validating this set
        name = f"validate-{taskset_id}-{uuid.uuid4().hex[:8]}"
        self.running[taskset_id] = self.runtime.spawn(self._validate(taskset_id), name)
        return name

    async def _validate(self, taskset_id: str) -> None:
        assert self.runtime.db is not None, "validation needs the database"
        settings = self.runtime.settings
        manager = SandboxManager(
            scoring_sandbox_settings(settings.sandbox), distributed=False, store=self.runtime.store
        )
        await manager.start()
        try:
            counts = await validate_taskset(self.runtime.db, Scorer(manager), taskset_id)
        finally:
            # the service's stop cancels a validation in flight: the manager still closes to
            # the end (its sandboxes and spawner process), or they outlive the event loop
            closing = asyncio.ensure_future(manager.close())
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                await closing
                raise
            finally:
                self.running.pop(taskset_id, None)
        log_event(log, "task set validated in process", taskset_id=taskset_id, counts=counts)
