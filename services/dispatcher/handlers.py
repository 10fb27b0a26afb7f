"""Typed bus handlers of the dispatcher, one per topic. Partitioning by episode key means
one replica handles one episode's results in order; the episode state machine copes with the
rest (duplicates, stale attempts, a rebalance that hands a partition over mid-message)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.dispatcher.episodes import EpisodeMachine
from services.dispatcher.scheduler import Scheduler
from temper.events import InferenceResult, PolicyUpdate, RewardResult, SandboxResult, Topics

Handlers = dict[str, Callable[[Any], Awaitable[None]]]


def result_topics(machine: EpisodeMachine) -> Handlers:
    """``inference.results``, ``sandbox.results``, ``reward.results``: one consumer group."""

    async def on_inference_result(message: InferenceResult) -> None:
        await machine.on_inference(message)

    async def on_sandbox_result(message: SandboxResult) -> None:
        await machine.on_sandbox(message)

    async def on_reward_result(message: RewardResult) -> None:
        await machine.on_reward(message)

    return {
        Topics.INFERENCE_RESULTS: on_inference_result,
        Topics.SANDBOX_RESULTS: on_sandbox_result,
        Topics.REWARD_RESULTS: on_reward_result,
    }


def result_batches(machine: EpisodeMachine) -> Handlers:
    """Batches of ``inference.results`` or ``sandbox.results`` (distinct episodes, one
    partition's fetch) in one transaction each; reward results go one at a time (each
    writes its trajectory to object storage between two transactions)."""

    async def on_inference_results(messages: list[InferenceResult]) -> None:
        await machine.on_results(messages)

    async def on_sandbox_results(messages: list[SandboxResult]) -> None:
        await machine.on_results(messages)

    return {Topics.INFERENCE_RESULTS: on_inference_results, Topics.SANDBOX_RESULTS: on_sandbox_results}


def policy_topics(scheduler: Scheduler) -> Handlers:
    """``policy.updates``, in its own group."""

    async def on_policy_update(message: PolicyUpdate) -> None:
        await scheduler.on_policy_update(message)

    return {Topics.POLICY_UPDATES: on_policy_update}
