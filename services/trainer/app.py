"""The trainer's process: the :class:`Trainer` on a :class:`Runtime`, with ``/health``,
``/metrics`` and ``GET /v1/status`` (policy version, step, buffer and skips per job)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from services.trainer.component import Trainer
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="trainer")
    trainer = Trainer(runtime)
    app = service_app(runtime, trainer, title="Temper trainer", version="1")
    app.state.trainer = trainer

    @app.get("/v1/status", summary="Policy version, step, buffered trajectories and skipped groups per job")
    async def status() -> dict[str, Any]:
        return trainer.status()

    return app
