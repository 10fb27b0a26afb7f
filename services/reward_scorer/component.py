"""The reward scorer as a component on the shared :class:`temper.runtime.Runtime`: its own
sandbox manager (fresh sandboxes for scoring, never an agent's), the
:class:`services.reward_scorer.scoring.SubmissionScorer` on it, and the ``reward.requests``
consumer, and the ``judge.results`` consumer of its judges (:mod:`services.reward_scorer.judging`).
``stop()`` stops the consumers before the sandboxes go, so no score is cut off half-way by
its own shutdown."""

from __future__ import annotations

from services.reward_scorer import handlers
from services.reward_scorer.judging import JudgeClient
from services.reward_scorer.scoring import SubmissionScorer
from temper.bus import Consumer
from temper.events import Topics
from temper.rewards.graders import Graders
from temper.rewards.runner import scoring_sandbox_settings
from temper.runtime import Runtime
from temper.sandbox import SandboxManager


class RewardScorer:
    """``manager`` replaces the sandbox manager built from the settings (tests share one);
    ``concurrency`` (default ``TEMPER_REWARD_SCORER__CONCURRENCY``) bounds the scores
    running at once; ``group`` (default ``TEMPER_REWARD_SCORER__GROUP``) is the consumer
    group. After ``start()``, ``scoring`` is the scorer."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        manager: SandboxManager | None = None,
        concurrency: int | None = None,
        group: str | None = None,
    ) -> None:
        settings = runtime.settings.reward_scorer
        self.runtime = runtime
        self.group = group or settings.group
        self.concurrency = concurrency or settings.concurrency
        self.manager = manager
        self._own_manager = manager is None
        self._scoring: SubmissionScorer | None = None
        self.consumer: Consumer | None = None
        self.judge_consumer: Consumer | None = None
        self.judges: JudgeClient | None = None

    @property
    def scoring(self) -> SubmissionScorer:
        assert self._scoring is not None, "the reward scorer is not started"
        return self._scoring

    async def start(self) -> None:
        rt = self.runtime
        if rt.db is None or rt.bus is None or rt.store is None:
            raise RuntimeError(
                "RewardScorer needs a started Runtime with a database, a bus and an object store"
            )
        if self.manager is None:
            self.manager = SandboxManager(
                scoring_sandbox_settings(rt.settings.sandbox),
                distributed=rt.settings.mode == "distributed",
                store=rt.store,  # task images are pulled from it
            )
            await self.manager.start()
        settings = rt.settings.reward_scorer
        self.judges = JudgeClient(rt.bus)
        graders = Graders(
            store=rt.store,
            device=settings.model_device.value,
            cache_dir=settings.model_cache_dir,
            max_batch=settings.model_batch,
            ask=self.judges.ask,
        )
        self._scoring = SubmissionScorer(
            rt.db, rt.store, self.manager, concurrency=self.concurrency, graders=graders
        )
        rt.checks["sandbox"] = self._check_sandbox
        # the gateway's answers to this replica's judges: a group of its own, from the topic's end
        await rt.bus.start_group_at_end(self.judges.group, [Topics.JUDGE_RESULTS])
        self.judge_consumer = await rt.consume_handlers(
            handlers.judge_topics(self.judges), group=self.judges.group
        )
        self.consumer = await rt.consume_handlers(
            handlers.topics(self._scoring, rt.bus), group=self.group, concurrency=self.concurrency
        )

    async def stop(self) -> None:
        for consumer in (self.consumer, self.judge_consumer):
            if consumer is not None:
                await consumer.stop()
        self.consumer = self.judge_consumer = None
        if self.manager is not None and self._own_manager:
            await self.manager.close()

    async def _check_sandbox(self) -> None:
        if self.manager is None or self.manager.backend is None:
            raise RuntimeError("sandbox manager not started")
