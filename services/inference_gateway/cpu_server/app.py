"""The CPU model server's app: the batch scheduler started and stopped with the app, and
its routes (``routes.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.routes import add_routes
from temper.storage import ObjectStore


def create_app(
    scheduler: BatchScheduler,
    *,
    model_name: str = "temper-policy",
    store: ObjectStore | None = None,
    cache_dir: str | Path = ".temper/engine-checkpoints",
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await scheduler.start()
        yield
        await scheduler.stop()

    app = FastAPI(title="Temper CPU engine", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.last_switch_s = None
    add_routes(app, scheduler, model_name=model_name, store=store, cache_dir=cache_dir)
    return app
