"""The reward scorer's way to the inference gateway, for judges (``temper.rewards.judge``).

A judge's question is an :class:`temper.events.InferenceRequest` sent on
``inference.requests`` like a turn of an episode, with ``reply_to: judge.results``; the
gateway answers there. Each scorer replica reads ``judge.results`` in a consumer group of
its own (placed at the topic's end when it starts, so it never replays old answers) and
hands an answer to the question waiting for it, found by the request's episode id (unique
per question); answers to another replica's questions, or to a question that timed out,
are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from temper import metrics
from temper.bus import Bus
from temper.events import InferenceRequest, InferenceResult, Topics
from temper.logs import log_event

log = logging.getLogger("temper.reward_scorer.judging")


class JudgeClient:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.group = f"reward-scorer-judge-{uuid.uuid4().hex[:12]}"
        self.waiting: dict[str, asyncio.Future[InferenceResult]] = {}
        self.answered = 0
        self.dropped = 0

    async def ask(self, request: InferenceRequest, timeout_s: float) -> InferenceResult:
        """Send ``request`` and wait up to ``timeout_s`` for its answer (TimeoutError past it)."""
        key = request.episode_id
        if not key or request.reply_to != Topics.JUDGE_RESULTS:
            raise ValueError("a judge's question has an episode id of its own and reply_to judge.results")
        future: asyncio.Future[InferenceResult] = asyncio.get_running_loop().create_future()
        self.waiting[key] = future
        t0 = asyncio.get_running_loop().time()
        try:
            await self.bus.send_message(Topics.INFERENCE_REQUESTS, request)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.waiting.pop(key, None)
            metrics.JUDGE_SECONDS.observe(asyncio.get_running_loop().time() - t0)

    async def on_answer(self, message: InferenceResult) -> None:
        future = self.waiting.get(message.episode_id or "")
        if future is None or future.done():
            self.dropped += 1
            return
        self.answered += 1
        future.set_result(message)
        if message.error is not None:
            log_event(log, "the gateway could not answer a judge", logging.WARNING, error=message.error[:300])
