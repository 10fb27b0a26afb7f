"""Typed bus handlers of the reward scorer, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.reward_scorer.judging import JudgeClient
from services.reward_scorer.scoring import SubmissionScorer
from temper.bus import Bus
from temper.events import InferenceResult, RewardRequest, Topics


def topics(scoring: SubmissionScorer, bus: Bus) -> dict[str, Callable[[Any], Awaitable[None]]]:
    async def on_reward_request(message: RewardRequest) -> None:
        # scored once per (episode, turn, attempt); a redelivery gets the recorded result again
        result = await scoring.result_for(message)
        await bus.send_message(Topics.REWARD_RESULTS, result)

    return {Topics.REWARD_REQUESTS: on_reward_request}


def judge_topics(client: JudgeClient) -> dict[str, Callable[[Any], Awaitable[None]]]:
    """``judge.results``, in this replica's own group: the gateway's answers to judges."""

    async def on_judge_result(message: InferenceResult) -> None:
        await client.on_answer(message)

    return {Topics.JUDGE_RESULTS: on_judge_result}
