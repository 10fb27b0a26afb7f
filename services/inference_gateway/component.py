"""The gateway as a component on the shared :class:`temper.runtime.Runtime`: it starts and
stops the :class:`Inference` (its backends), the consumers of ``inference.requests``
and ``policy.updates`` (``handlers.py``), the loop that loads policy updates
(``updates.py``), the backpressure loop (``flow.py``) and the version watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from services.inference_gateway import handlers
from services.inference_gateway.agents import AgentProxy
from services.inference_gateway.flow import RequestFlow
from services.inference_gateway.inference import Inference
from services.inference_gateway.updates import PolicyUpdates
from temper.bus import Consumer
from temper.events import InferenceResult, Topics
from temper.logs import log_event
from temper.policy.placement import deployment_backends
from temper.runtime import Runtime
from temper.settings import Mode
from temper.settings.inference import InferenceSettings

log = logging.getLogger("services.inference_gateway")

REQUESTS_GROUP = "inference-gateway"


class BackendsDown(RuntimeError):
    """No backend can take a request (for /health)."""


def effective_settings(settings: InferenceSettings, mode: Mode) -> InferenceSettings:
    """Embedded mode with no backend configured serves from an in-process CPU runner."""
    backends = deployment_backends(settings, embedded=mode is Mode.embedded)
    return settings if backends == settings.backends else settings.model_copy(update={"backends": backends})


class Gateway:
    """Construct with a :class:`Runtime` (bus and object store; no database), then
    ``await start()`` after ``runtime.start()`` and ``await stop()`` before ``runtime.stop()``.

    ``inference`` replaces the :class:`Inference` built from the settings (tests, or an
    embedded runner that brings its own backends). ``group`` (default
    ``TEMPER_INFERENCE__REQUESTS_GROUP``, ``inference-gateway``) and ``policy_group`` (default
    ``TEMPER_INFERENCE__POLICY_GROUP``, else ``inference-gateway-<uuid>``) name the consumer
    groups; ``concurrency`` defaults to the backends' total in-flight capacity.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        inference: Inference | None = None,
        group: str | None = None,
        policy_group: str | None = None,
        concurrency: int | None = None,
        flow_interval_s: float = 0.02,
        policy_retries: int = 3,
    ) -> None:
        self.runtime = runtime
        settings = effective_settings(runtime.settings.inference, runtime.settings.mode)
        self.inference = inference or Inference(settings)
        self.group = group or settings.requests_group
        self.policy_group = (
            policy_group or settings.policy_group or f"{REQUESTS_GROUP}-{uuid.uuid4().hex[:12]}"
        )
        capacity = sum(s.max_inflight for s in self.inference.router.slots.values())
        self.concurrency = concurrency or max(1, capacity)
        self.flow = RequestFlow(self.inference.has_capacity, interval_s=flow_interval_s)
        self.updates = PolicyUpdates(runtime, self.inference, retries=policy_retries)
        # each agent episode's base URL (routes.add_agent_routes): the database the updates
        # read (the runtime's, else the shared one) and the runtime's object store
        self.agents = AgentProxy(self.inference, database=self.updates.database, store=lambda: runtime.store)
        self.requests: Consumer | None = None
        self.policy: Consumer | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        rt = self.runtime
        if rt.bus is None:
            raise RuntimeError("Gateway needs a started Runtime with a bus")
        if self.inference.store is None:
            self.inference.store = rt.store
        await self.inference.start(health_loop=False)
        rt.checks["backends"] = self.check_backends
        self._tasks.append(rt.spawn(self.inference.router.health_loop(), "gateway-health"))
        self._tasks.append(rt.spawn(self.updates.run(), "gateway-policy-updates"))
        if self.updates.database() is not None:
            # The jobs' current versions come from the database (load_current, below); a
            # new group that replayed the topic would load every past job's versions.
            await rt.bus.start_group_at_end(self.policy_group, [Topics.POLICY_UPDATES])
        self.policy = await rt.consume_handlers(handlers.policy_topics(self.updates), group=self.policy_group)
        # The jobs' current versions before any request: never what a group replays.
        await self.updates.load_current()
        self.requests = await rt.consume_handlers(
            handlers.request_topics(self.inference, self.flow, self._send),
            group=self.group,
            concurrency=self.concurrency,
        )
        self.flow.consumer = self.requests
        self.flow.sync()  # no backend up yet: keep the requests on the bus
        self._tasks.append(rt.spawn(self.flow.run(), "gateway-flow"))
        self._tasks.append(rt.spawn(self.updates.watch(), "gateway-version-watch"))
        log_event(
            log,
            "gateway started",
            backends=list(self.inference.router.slots),
            group=self.group,
            policy_group=self.policy_group,
            concurrency=self.concurrency,
            served=self.inference.table.snapshot(),
        )

    async def _send(self, result: InferenceResult, topic: str = Topics.INFERENCE_RESULTS) -> None:
        assert self.runtime.bus is not None
        await self.runtime.bus.send_message(topic, result)

    async def stop(self) -> None:
        """Its consumers first, then its loops (before the backends close under them)."""
        for consumer in (self.requests, self.policy):
            if consumer is not None:
                await consumer.stop()
        self.requests = self.policy = None
        self.flow.consumer = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self.runtime.checks.pop("backends", None)
        await self.updates.close()
        await self.inference.stop()

    async def check_backends(self) -> None:
        slots = self.inference.router.slots
        if not slots:
            raise BackendsDown("none configured (set TEMPER_INFERENCE__BACKENDS)")
        down = [s.name for s in slots.values() if not s.healthy or not s.breaker.can_try()]
        if len(down) == len(slots):
            raise BackendsDown("all down: " + ", ".join(down))

    def status(self) -> dict[str, Any]:
        return {
            **self.inference.status(),
            "requests_group": self.group,
            "policy_group": self.policy_group,
            "paused": self.flow.paused,
            "answered": self.inference.answered,
            "failed": self.inference.failed,
            "pauses": self.flow.pauses,
            "updates_applied": self.updates.updates_applied,
            "update_errors": self.updates.update_errors,
            "waiting": dict(self.updates.waiting),
        }
