"""The gateway as a component on the shared :class:`temper.runtime.Runtime`.

:class:`Gateway` wires :class:`InferenceService` to the bus:

- ``inference.requests`` (group ``inference-gateway``, shared by all replicas): each
  :class:`InferenceRequest` is generated and answered with one :class:`InferenceResult`
  on ``inference.results``, keyed by the episode and carrying the request's job, episode,
  turn and attempt plus the policy version. A request that fails after the router's
  retry budget is answered with ``error`` set, never dropped. The offset is committed
  only after the result was sent, so a crash redelivers the request and it is generated
  again (generation is stateless); the second result has the same key and envelope and
  the dispatcher keeps the first.
- Backpressure: while every backend is full (or down) the request consumer is paused and
  the backlog stays in Kafka; it resumes as soon as a slot frees.
- The current policy at start: before it takes a request, a gateway loads the newest
  published version of the running jobs from the database (``policy_versions``), so a
  restarted replica never serves version 0 (or whatever its policy group would replay)
  while the trainer is at v22. Without a database it falls back to the updates it reads.
- ``policy.updates`` (group ``TEMPER_INFERENCE__POLICY_GROUP``, else
  ``inference-gateway-<uuid>``, one per replica so every replica sees every update).
  Updates are coalesced: only the newest pending version is loaded (a replay of v1..v9
  loads v9 once), and versions at or below the served one are ignored.
- A backend that restarted (an engine server back at its initial weights) is noticed by
  the version watch (``served_version`` below the gateway's) and reloaded with the
  current version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from sqlalchemy import select

from services.inference_gateway import handlers
from services.inference_gateway.inference import InferenceService
from temper.bus import Consumer
from temper.db import Database, Job, PolicyVersion
from temper.events import InferenceRequest, PolicyUpdate, Topics
from temper.lifecycle import JobState
from temper.logs import log_event
from temper.runtime import Runtime
from temper.settings import Mode
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings

log = logging.getLogger("services.inference_gateway")

REQUESTS_GROUP = "inference-gateway"


class BackendsDown(RuntimeError):
    """No backend can take a request (for /health)."""


def effective_settings(settings: InferenceSettings, mode: Mode) -> InferenceSettings:
    """Embedded mode with no backend configured serves from an in-process CPU engine."""
    if settings.backends or mode is not Mode.embedded:
        return settings
    return settings.model_copy(update={"backends": [BackendSpec(name="local-0", kind=BackendKind.local)]})


class Gateway:
    """Construct with a :class:`Runtime` (bus and object store; no database), then
    ``await start()`` after ``runtime.start()`` and ``await stop()`` before ``runtime.stop()``.

    ``service`` replaces the :class:`InferenceService` built from the settings (tests, or an
    embedded runner that brings its own backends). ``group`` (default
    ``TEMPER_INFERENCE__REQUESTS_GROUP``, ``inference-gateway``) and ``policy_group`` (default
    ``TEMPER_INFERENCE__POLICY_GROUP``, else ``inference-gateway-<uuid>``) name the consumer groups; ``concurrency`` defaults to the backends' total in-flight capacity.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        service: InferenceService | None = None,
        group: str | None = None,
        policy_group: str | None = None,
        concurrency: int | None = None,
        flow_interval_s: float = 0.02,
        policy_retries: int = 3,
    ) -> None:
        self.runtime = runtime
        settings = effective_settings(runtime.settings.inference, runtime.settings.mode)
        self.service = service or InferenceService(settings)
        self.group = group or settings.requests_group
        self.policy_group = (
            policy_group or settings.policy_group or f"{REQUESTS_GROUP}-{uuid.uuid4().hex[:12]}"
        )
        capacity = sum(s.max_inflight for s in self.service.router.slots.values())
        self.concurrency = concurrency or max(1, capacity)
        self.flow_interval_s = flow_interval_s
        self.policy_retries = policy_retries
        self.requests: Consumer | None = None
        self.updates: Consumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[str, PolicyUpdate] = {}  # job -> newest update not applied yet
        self._current: PolicyUpdate | None = None  # the version served, for the version watch
        self._update_ready = asyncio.Event()
        self._flow_changed = asyncio.Event()
        # counters for /v1/status and tests
        self.answered = 0
        self.failed = 0
        self.pauses = 0
        self.updates_applied = 0
        self.update_errors = 0

    # --- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        rt = self.runtime
        if rt.bus is None:
            raise RuntimeError("Gateway needs a started Runtime with a bus")
        if self.service.store is None:
            self.service.store = rt.store
        await self.service.start()
        rt.checks["backends"] = self.check_backends
        self._tasks.append(asyncio.create_task(self._apply_updates(), name="gateway-policy-updates"))
        self.updates = await rt.consume_handlers(handlers.policy_topics(self), group=self.policy_group)
        # The job's current version before any request: never what a group replays.
        await self._load_current_policy()
        self.requests = await rt.consume_handlers(
            handlers.request_topics(self), group=self.group, concurrency=self.concurrency
        )
        self._sync_flow()  # no backend up yet: keep the requests on the bus
        self._tasks.append(asyncio.create_task(self._flow(), name="gateway-flow"))
        self._tasks.append(asyncio.create_task(self._watch_versions(), name="gateway-version-watch"))
        log_event(
            log,
            "gateway started",
            backends=list(self.service.router.slots),
            group=self.group,
            policy_group=self.policy_group,
            concurrency=self.concurrency,
            policy_version=self.service.policy_version,
        )

    async def stop(self) -> None:
        for consumer in (self.requests, self.updates):
            if consumer is not None:
                await consumer.stop()
        self.requests = self.updates = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self.runtime.checks.pop("backends", None)
        await self.service.stop()

    # --- inference.requests ---------------------------------------------------------------------
    async def on_request(self, message: InferenceRequest) -> None:
        work = asyncio.ensure_future(self.service.handle(message))
        try:
            await asyncio.sleep(0)  # let it take its backend slot, then see if that was the last one
            self._sync_flow()
            result = await work
        finally:
            if not work.done():
                work.cancel()
            self._flow_changed.set()
        assert self.runtime.bus is not None
        await self.runtime.bus.send_message(Topics.INFERENCE_RESULTS, result)
        if result.error is None:
            self.answered += 1
        else:
            self.failed += 1
            log_event(log, "inference failed", logging.WARNING, error=result.error)

    def _sync_flow(self) -> None:
        """Pause the request consumer while no backend has room; resume when one has."""
        c = self.requests
        if c is None:
            return
        has = self.service.has_capacity()
        if not has and not c.paused:
            c.pause()
            self.pauses += 1
        elif has and c.paused:
            c.resume()

    async def _flow(self) -> None:
        # Resume on a finished request at once; poll too, for backends that come back up.
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flow_changed.wait(), self.flow_interval_s)
            self._flow_changed.clear()
            self._sync_flow()

    # --- policy.updates -----------------------------------------------------------------------------
    async def on_policy_update(self, message: PolicyUpdate) -> None:
        if message.version <= self.service.job_version(message.job_id):
            return  # already served (or older): idempotent
        pending = self._pending.get(message.job_id or "")
        if pending is None or message.version > pending.version:
            self._pending[message.job_id or ""] = message
            self._update_ready.set()

    async def current_policy(self) -> PolicyUpdate | None:
        """The newest published policy version of a job that is not finished."""
        current = await self.current_policies()
        return current[-1] if current else None

    async def current_policies(self) -> list[PolicyUpdate]:
        """The newest published policy version of every job that is not finished, oldest
        first, from the database (the runtime's, or the configured one for a gateway
        without its own)."""
        db, own = self.runtime.db, False
        if db is None:
            settings = self.runtime.settings
            if settings.mode is not Mode.distributed or settings.db.url.startswith("sqlite"):
                return []  # no shared database to ask: the updates it reads will do
            db, own = Database(settings.db), True
        try:
            async with db.session() as s:
                rows = (
                    await s.execute(
                        select(PolicyVersion)
                        .join(Job, Job.id == PolicyVersion.job_id)
                        .where(Job.state.in_([JobState.pending, JobState.running, JobState.paused]))
                        .order_by(PolicyVersion.created_at, PolicyVersion.version)
                    )
                ).scalars()
                newest = {row.job_id: row for row in rows}  # the last row of a job is its newest
        finally:
            if own:
                await db.dispose()
        ordered = sorted(newest.values(), key=lambda r: (r.created_at, r.version))
        return [
            PolicyUpdate(job_id=r.job_id, version=r.version, checkpoint_key=r.checkpoint_key, step=r.step)
            for r in ordered
        ]

    async def _load_current_policy(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                for current in await self.current_policies():
                    if current.version > self.service.job_version(current.job_id):
                        await self.service.apply_update(current)
                        self._current = current
                        self.updates_applied += 1
                        log_event(
                            log,
                            "policy version loaded at start",
                            version=current.version,
                            job_id=current.job_id,
                            checkpoint_key=current.checkpoint_key,
                        )
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - serve what the updates bring rather than not start
                log_event(
                    log,
                    "cannot load the current policy version at start",
                    logging.WARNING,
                    attempt=attempt,
                    error=repr(exc)[:300],
                )
                if attempt < attempts:
                    await asyncio.sleep(0.5 * attempt)

    async def _watch_versions(self) -> None:
        """Reload a backend that serves less than the gateway's version (it restarted)."""
        interval = max(0.5, self.service.settings.health_interval_s)
        while True:
            await asyncio.sleep(interval)
            current = self._current
            if current is None or current.version != self.service.policy_version:
                continue
            behind = False
            for slot in self.service.router.slots.values():
                probe = getattr(slot.backend, "served_version", None)
                served = await probe() if probe is not None else None
                if served is not None and served < current.version:
                    slot.backend.version = served
                    behind = True
            if behind:
                log_event(log, "a backend restarted behind; reloading it", version=current.version)
                with contextlib.suppress(Exception):
                    await self.service.apply_update(current)

    async def _apply_updates(self) -> None:
        while True:
            await self._update_ready.wait()
            self._update_ready.clear()
            while self._pending:
                _, update = self._pending.popitem()
                if update.version > self.service.job_version(update.job_id):
                    await self._apply_one(update)

    async def _apply_one(self, update: PolicyUpdate) -> None:
        """Apply one job's newest update, retried; a newer one queued meanwhile wins."""
        for attempt in range(1, self.policy_retries + 1):
            try:
                times = await self.service.apply_update(update)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bad checkpoint must not stop the gateway
                queued = self._pending.get(update.job_id or "")
                newer = queued is not None and queued.version > update.version
                log_event(
                    log,
                    "policy update failed",
                    logging.ERROR,
                    version=update.version,
                    checkpoint_key=update.checkpoint_key,
                    attempt=attempt,
                    error=repr(exc),
                )
                if newer or attempt == self.policy_retries:
                    self.update_errors += 1
                    return
                await asyncio.sleep(0.5 * attempt)
                continue
            self.updates_applied += 1
            self._current = update
            log_event(
                log,
                "policy version switched",
                version=update.version,
                job_id=update.job_id,
                switch_ms={k: round(v * 1000, 3) for k, v in times.items()},
            )
            return

    # --- health and status ---------------------------------------------------------------------------
    async def check_backends(self) -> None:
        slots = self.service.router.slots
        if not slots:
            raise BackendsDown("none configured (set TEMPER_INFERENCE__BACKENDS)")
        down = [s.name for s in slots.values() if not s.healthy or not s.breaker.can_try()]
        if len(down) == len(slots):
            raise BackendsDown("all down: " + ", ".join(down))

    def status(self) -> dict[str, Any]:
        return {
            **self.service.status(),
            "requests_group": self.group,
            "policy_group": self.policy_group,
            "paused": bool(self.requests and self.requests.paused),
            "answered": self.answered,
            "failed": self.failed,
            "pauses": self.pauses,
            "updates_applied": self.updates_applied,
            "update_errors": self.update_errors,
        }
