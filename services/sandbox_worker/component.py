"""The sandbox worker component (see docs/architecture.md, "One skeleton per service"):
built on a :class:`temper.runtime.Runtime`, it consumes ``sandbox.requests``, runs each
through the :class:`SandboxWorker` and publishes ``sandbox.results``, pausing the
consumer while every action slot is taken.
"""

from __future__ import annotations

import logging
from typing import Any

from services.sandbox_worker import handlers
from services.sandbox_worker.worker import SandboxWorker
from temper.logs import log_event
from temper.runtime import Runtime
from temper.settings import Mode
from temper.settings.sandbox import SandboxSettings

log = logging.getLogger(__name__)

HEALTH_CHECK = "sandbox_worker"  # the component's entry in runtime.checks (and /health)


def with_gateway(sandbox: SandboxSettings, agent_url: str | None) -> SandboxSettings:
    """``sandbox`` whose allowlist proxy may reach the gateway agents call
    (``TEMPER_AGENT__URL``) even where it resolves to a private address: an agent's sandbox
    lists it (``temper.envs.agent``); nothing else private is let through."""
    if agent_url is None:
        return sandbox
    target = agent_url.removeprefix("http://")
    if target in sandbox.egress_private_targets:
        return sandbox
    return sandbox.model_copy(update={"egress_private_targets": [*sandbox.egress_private_targets, target]})


class SandboxWorkerComponent:
    """The sandbox worker component: ``sandbox.requests`` in, ``sandbox.results`` out.

    Built on a shared :class:`Runtime` (bus and object store; no database). ``start()``
    starts the sandboxes and joins consumer group ``group`` (default
    ``TEMPER_SANDBOX__GROUP``, ``sandbox-worker``) with ``concurrency``
    partitions in flight; while every action slot of the worker is taken (bus steps and
    HTTP calls alike) the consumer is paused, and it resumes when one frees, so nothing
    is buffered beyond the fetch in hand. ``stop()`` leaves the group, then destroys
    every session and pooled sandbox.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        sandbox: SandboxSettings | None = None,
        worker_id: str | None = None,
        group: str | None = None,
    ) -> None:
        self.runtime = runtime
        s = runtime.settings
        sandbox = with_gateway(sandbox or s.sandbox, s.agent.url)
        self.worker = SandboxWorker(sandbox, distributed=s.mode is Mode.distributed, worker_id=worker_id)
        self.group = group or sandbox.group
        self.consumer: Any = None
        self.pauses = 0
        self.worker.load_listeners.append(self._on_load)

    async def start(self) -> None:
        # The runtime made its store in start(); snapshots go there.
        self.worker.store = self.worker.manager.store = self.runtime.store
        await self.worker.start()
        # Its own name: on a shared runtime (embedded) the reward scorer checks its sandboxes too.
        self.runtime.checks[HEALTH_CHECK] = self._check_sandbox
        try:
            self.consumer = await self.runtime.consume_handlers(
                handlers.topics(self.worker, self.runtime),
                group=self.group,
                concurrency=self.worker.settings.concurrency,
            )
        except BaseException:
            await self.worker.close()
            raise

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        if self.runtime.checks.get(HEALTH_CHECK) == self._check_sandbox:
            del self.runtime.checks[HEALTH_CHECK]
        await self.worker.close()

    def _on_load(self, full: bool) -> None:
        consumer = self.consumer
        if consumer is None:
            return
        if full and not consumer.paused:
            self.pauses += 1
            log_event(log, "sandbox worker full: consumer paused", slots=self.worker.settings.concurrency)
            consumer.pause()
        elif not full and consumer.paused:
            consumer.resume()

    async def _check_sandbox(self) -> None:
        manager = self.worker.manager
        if not manager.started:
            raise RuntimeError("sandboxes not started")
        if manager.leaked:
            raise RuntimeError(f"{manager.leaked} leaked sandbox processes")
