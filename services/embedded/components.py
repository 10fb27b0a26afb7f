"""The five services as components on one runtime, started in dependency order
(executors before the dispatcher that feeds them) and stopped in reverse."""

from __future__ import annotations

from typing import Any

from services.dispatcher.component import Dispatcher
from services.inference_gateway.component import Gateway
from services.reward_scorer.component import RewardScorer
from services.sandbox_worker.component import SandboxWorkerService
from services.trainer.component import Trainer
from temper.runtime import Component, Runtime


class Components:
    def __init__(self, runtime: Runtime, **trainer_options: Any) -> None:
        # The dispatcher's relay publishes every outbox row; a second relay on the same
        # SQLite table would publish rows twice.
        trainer_settings = runtime.settings.trainer.model_copy(update={"run_relay": False})
        # One job on a laptop: tick quickly rather than save queries.
        dispatcher_settings = runtime.settings.dispatcher.model_copy(
            update={"scheduler_interval_s": 0.1, "reaper_interval_s": 0.5}
        )
        self.ordered: list[Component] = [
            SandboxWorkerService(runtime),
            Gateway(runtime),
            RewardScorer(runtime),
            Trainer(runtime, settings=trainer_settings, **trainer_options),
            Dispatcher(runtime, settings=dispatcher_settings),
        ]
        self.started: list[Component] = []

    async def start(self) -> None:
        for component in self.ordered:
            await component.start()
            self.started.append(component)

    async def stop(self) -> None:
        while self.started:
            await self.started.pop().stop()
