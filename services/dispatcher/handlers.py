"""Typed bus handlers of the dispatcher, one per topic. Partitioning by episode key means
one replica handles one episode's results in order; the episode state machine copes with the
rest (duplicates, stale attempts, a rebalance that hands a partition over mid-message)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.dispatcher.batches import ResultBatches
from services.dispatcher.scheduler import Scheduler
from temper.events import InferenceResult, PolicyUpdate, RewardResult, SandboxResult, Topics

Handlers = dict[str, Callable[[Any], Awaitable[None]]]


def result_topics(batches: ResultBatches) -> Handlers:
    """``inference.results``, ``sandbox.results``, ``reward.results``: one consumer group.
    Results handed over at the same moment share a transaction (``batches.py``)."""

    async def on_inference_result(message: InferenceResult) -> None:
        await batches.take([message])

    async def on_sandbox_result(message: SandboxResult) -> None:
        await batches.take([message])

    async def on_reward_result(message: RewardResult) -> None:
        await batches.take([message])

    return {
        Topics.INFERENCE_RESULTS: on_inference_result,
        Topics.SANDBOX_RESULTS: on_sandbox_result,
        Topics.REWARD_RESULTS: on_reward_result,
    }


def result_batches(batches: ResultBatches) -> Handlers:
    """Batches of each result topic (distinct episodes, one partition's fetch), with
    whatever else is handed over then."""

    async def on_inference_results(messages: list[InferenceResult]) -> None:
        await batches.take(messages)

    async def on_sandbox_results(messages: list[SandboxResult]) -> None:
        await batches.take(messages)

    async def on_reward_results(messages: list[RewardResult]) -> None:
        await batches.take(messages)

    return {
        Topics.INFERENCE_RESULTS: on_inference_results,
        Topics.SANDBOX_RESULTS: on_sandbox_results,
        Topics.REWARD_RESULTS: on_reward_results,
    }


def policy_topics(scheduler: Scheduler) -> Handlers:
    """``policy.updates``, in its own group."""

    async def on_policy_update(message: PolicyUpdate) -> None:
        await scheduler.on_policy_update(message)

    return {Topics.POLICY_UPDATES: on_policy_update}
