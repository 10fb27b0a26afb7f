"""Typed bus handlers of the inference gateway, one per topic it consumes. The two topics
are read in different consumer groups (requests are shared by the gateway replicas, every
replica reads every policy update), so each map is subscribed on its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from services.inference_gateway.flow import RequestFlow
from services.inference_gateway.inference import Inference
from services.inference_gateway.updates import PolicyUpdates
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate, Topics
from temper.logs import log_event

log = logging.getLogger("services.inference_gateway")

Handlers = dict[str, Callable[[Any], Awaitable[None]]]


def request_topics(
    inference: Inference, flow: RequestFlow, send: Callable[[InferenceResult, str], Awaitable[None]]
) -> Handlers:
    """``inference.requests`` (group ``inference-gateway``, shared by all replicas): each
    request is generated and answered with one result on the topic it names (``reply_to``:
    ``inference.results`` for the dispatcher's episodes, ``judge.results`` for a reward
    scorer's judge), keyed by the episode and carrying the request's job, episode, turn and
    attempt plus the policy version. A request that fails after the router's retry budget is answered with
    ``error`` set, never dropped. The offset is committed only after the result was sent,
    so a crash redelivers the request and it is generated again (generation is
    stateless); the second result has the same key and envelope and the dispatcher keeps
    the first."""

    async def on_request(message: InferenceRequest) -> None:
        work = asyncio.ensure_future(inference.handle(message))
        try:
            await asyncio.sleep(0)  # let it take its backend slot, then see if that was the last one
            flow.sync()
            result = await work
        finally:
            if not work.done():
                work.cancel()
            flow.changed.set()
        await send(result, message.reply_to)
        if result.error is None:
            inference.answered += 1
        else:
            inference.failed += 1
            log_event(log, "inference failed", logging.WARNING, error=result.error)

    return {Topics.INFERENCE_REQUESTS: on_request}


def policy_topics(updates: PolicyUpdates) -> Handlers:
    """``policy.updates``, in the replica's own group: queue the newest version for the backends."""

    async def on_policy_update(message: PolicyUpdate) -> None:
        updates.offer(message)

    return {Topics.POLICY_UPDATES: on_policy_update}
