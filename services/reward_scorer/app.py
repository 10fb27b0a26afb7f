"""The reward scorer's process: the :class:`RewardScorer` on a :class:`Runtime`, with
``/health`` (503 names what is down) and ``/metrics``."""

from __future__ import annotations

from fastapi import FastAPI

from services.reward_scorer.component import RewardScorer
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="reward-scorer")
    scorer = RewardScorer(runtime)
    app = service_app(runtime, scorer, title="Temper reward scorer")
    app.state.scorer = scorer
    return app
