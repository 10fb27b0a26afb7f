"""HTTP face of the reward scorer: ``/health`` (503 names what is down) and ``/metrics``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.reward_scorer.component import RewardScorer
from temper.runtime import Runtime, health_router
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="reward-scorer")
    scorer = RewardScorer(runtime, concurrency=settings.sandbox.concurrency)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        await scorer.start()
        yield
        await scorer.stop()
        await runtime.stop()

    app = FastAPI(title="Temper reward scorer", lifespan=lifespan)
    app.state.runtime = runtime
    app.state.scorer = scorer
    app.include_router(health_router(runtime))
    return app
