"""The trainer's process: the :class:`Trainer` on a :class:`Runtime`, with ``/health``,
``/metrics`` and ``GET /v1/status`` (policy version, step, buffer and skips per job)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services.trainer.component import Trainer
from temper.runtime import Runtime, health_router
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="trainer")
    trainer = Trainer(runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            await trainer.start()
            yield
        finally:
            await trainer.stop()
            await runtime.stop()

    app = FastAPI(title="Temper trainer", version="1", lifespan=lifespan)
    app.state.trainer = trainer
    app.include_router(health_router(runtime))

    @app.get("/v1/status", summary="Policy version, step, buffered trajectories and skipped groups per job")
    async def status() -> dict[str, Any]:
        return trainer.status()

    return app
