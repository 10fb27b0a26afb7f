"""Typed bus handlers of the sandbox worker, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.sandbox_worker.worker import SandboxWorker
from temper.events import SandboxRequest, Topics
from temper.runtime import Runtime


def topics(worker: SandboxWorker, runtime: Runtime) -> dict[str, Callable[[Any], Awaitable[None]]]:
    async def on_sandbox_request(request: SandboxRequest) -> None:
        """Run the step (idempotent per episode, turn and attempt); answer on ``sandbox.results``."""
        result = await worker.handle(request)
        assert runtime.bus is not None
        await runtime.bus.send_message(Topics.SANDBOX_RESULTS, result)

    return {Topics.SANDBOX_REQUESTS: on_sandbox_request}
