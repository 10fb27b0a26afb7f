"""The trainer as a component on the shared :class:`temper.runtime.Runtime`: it builds the
:class:`services.trainer.training.JobTrainer` once the runtime has its database and object
store, joins torchrun's ranks, reloads the jobs the ledger still buffers, and owns the
``trajectories`` consumer, the training loop and (``TEMPER_TRAINER__RUN_RELAY``) an outbox
relay for the policy updates it writes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.trainer import handlers
from services.trainer.learners import ModelFactory
from services.trainer.ranks import Ranks
from services.trainer.training import JobTrainer
from temper.bus import Consumer
from temper.logs import log_event
from temper.outbox import OutboxRelay
from temper.runtime import Runtime
from temper.settings.trainer import TrainerSettings
from temper.training import StepStats

log = logging.getLogger("temper.trainer")
RECEIVE_CONCURRENCY = 64  # trajectories handed over at once, at most


class Trainer:
    """``settings`` replace ``runtime.settings.trainer`` (tests, the embedded runner);
    ``model_factory`` and ``on_step`` go to the :class:`JobTrainer`. After ``start()``,
    ``training`` is the job trainer."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        settings: TrainerSettings | None = None,
        model_factory: ModelFactory | None = None,
        on_step: Callable[[str, StepStats], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = settings or runtime.settings.trainer
        self.model_factory = model_factory
        self.on_step = on_step
        self._training: JobTrainer | None = None
        self.relay: OutboxRelay | None = None
        self.consumer: Consumer | None = None

    @property
    def training(self) -> JobTrainer:
        assert self._training is not None, "the trainer is not started"
        return self._training

    async def start(self) -> None:
        rt = self.runtime
        if rt.db is None or rt.bus is None or rt.store is None:
            raise RuntimeError("Trainer needs a started Runtime with a database, a bus and an object store")
        if self.settings.run_relay:
            self.relay = OutboxRelay(rt.db, rt.bus, keep_published_s=rt.settings.db.outbox_keep_published_s)
            rt.spawn(self.relay.run(), "outbox-relay")
        training = self._training = JobTrainer(
            rt.db, rt.store, self.settings, ranks=Ranks.from_env(), model_factory=self.model_factory,
            on_step=self.on_step, notify_outbox=self.relay.notify if self.relay is not None else rt.notify_outbox,
        )  # fmt: skip
        await training.start_ranks()
        await training.recover()
        rt.checks["trainer"] = training.check
        # trajectories of different episodes side by side, so that those handed over at
        # once share a ledger transaction (services.trainer.receipts)
        self.consumer = await rt.consume_handlers(
            handlers.topics(training), group=training.group, concurrency=RECEIVE_CONCURRENCY
        )
        rt.spawn(training.run(), "trainer-loop")
        log_event(log, "trainer started", group=training.group, device=str(training.device),
                  jobs=sorted(training.jobs), ranks=training.ranks.world)  # fmt: skip

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        if self._training is not None:
            await self._training.receipts.close()
            await asyncio.to_thread(self._training.ranks.stop)
