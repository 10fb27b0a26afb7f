"""Bus handlers: typed messages to the engine. Partitioning by episode key means one
replica handles one episode's results in order; the engine copes with the rest
(duplicates, stale attempts, a rebalance that hands a partition over mid-message)."""

from __future__ import annotations

import logging

from services.dispatcher.episodes import EpisodeEngine
from services.dispatcher.scheduler import Scheduler
from temper.events import InferenceResult, Message, PolicyUpdate, RewardResult, SandboxResult
from temper.logs import log_event

log = logging.getLogger("temper.dispatcher.handlers")


class ResultHandlers:
    def __init__(self, engine: EpisodeEngine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler

    async def on_result(self, message: Message) -> None:
        """``inference.results``, ``sandbox.results``, ``reward.results``."""
        if isinstance(message, InferenceResult):
            await self.engine.on_inference(message)
        elif isinstance(message, SandboxResult):
            await self.engine.on_sandbox(message)
        elif isinstance(message, RewardResult):
            await self.engine.on_reward(message)
        else:
            log_event(log, "unexpected message on a result topic", logging.WARNING, type=message.type)

    async def on_policy_update(self, message: Message) -> None:
        if isinstance(message, PolicyUpdate):
            await self.scheduler.on_policy_update(message)
