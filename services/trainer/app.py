"""The trainer's process: the :class:`Trainer` on a :class:`Runtime`, with ``/health``,
``/metrics`` and ``GET /v1/status`` (policy version, step, buffer and skips per job)."""

from __future__ import annotations

from fastapi import FastAPI

from services.trainer.component import Trainer
from services.trainer.routes import router
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="trainer")
    trainer = Trainer(runtime)
    app = service_app(runtime, trainer, title="Temper trainer", version="1")
    app.state.trainer = trainer
    app.include_router(router)
    return app
