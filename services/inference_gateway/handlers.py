"""Typed bus handlers of the inference gateway, one per topic it consumes. The two topics
are read in different consumer groups (requests are shared by the gateway replicas, every
replica reads every policy update), so each map is subscribed on its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from temper.events import Topics

if TYPE_CHECKING:
    from services.inference_gateway.component import Gateway

Handlers = dict[str, Callable[[Any], Awaitable[None]]]


def request_topics(gateway: Gateway) -> Handlers:
    # Gateway.on_request(message: InferenceRequest): route to a backend, answer on inference.results.
    return {Topics.INFERENCE_REQUESTS: gateway.on_request}


def policy_topics(gateway: Gateway) -> Handlers:
    # Gateway.on_policy_update(message: PolicyUpdate): queue the newest version for the backends.
    return {Topics.POLICY_UPDATES: gateway.on_policy_update}
