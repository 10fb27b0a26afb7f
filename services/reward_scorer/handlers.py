"""Typed bus handlers of the reward scorer, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from temper.events import Topics

if TYPE_CHECKING:
    from services.reward_scorer.component import RewardScorer


def topics(scorer: RewardScorer) -> dict[str, Callable[[Any], Awaitable[None]]]:
    # RewardScorer.handle(message: RewardRequest): score once per request id, answer on
    # reward.results (a redelivered request gets the recorded result again).
    return {Topics.REWARD_REQUESTS: scorer.handle}
