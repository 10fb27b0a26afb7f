"""Routing over several backends of one model.

- Episode stickiness: consistent hashing with bounded load. An episode's key is hashed
  onto a ring of virtual nodes; walking the ring from there, the first backend that is
  available and below ``ceil(load_factor * (outstanding + 1) / n)`` takes it. So an
  episode's turns land on the same backend (its prefix cache) unless that backend is
  busier than its share, and then they spill to the next one on the ring.
- Without an episode: least outstanding requests.
- Each backend has a bounded number of requests in flight, a health flag kept by a
  periodic probe, and a circuit breaker (closed -> open after N consecutive failures ->
  half-open after a pause, one trial request -> closed or open again).
- Timeouts, connection errors, 5xx and 429 are retried with exponential backoff and
  jitter on another backend; after the retry budget the request fails with the reason.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import math
import random
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram

from services.inference_gateway.backends import (
    Backend,
    BackendError,
    BackendResult,
    ErrorKind,
    GenerateRequest,
)
from services.inference_gateway.versions import Serving
from temper import metrics
from temper.settings.inference import InferenceSettings


class RequestFailed(Exception):
    """A request that failed after its retry budget; ``reason`` says why."""

    def __init__(self, reason: str, attempts: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts


class BreakerState(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


@dataclass
class CircuitBreaker:
    failures_to_open: int = 3
    reset_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.closed
    failures: int = 0
    opened_at: float = 0.0
    trial_inflight: bool = False

    def can_try(self) -> bool:
        if self.state is BreakerState.closed:
            return True
        if self.state is BreakerState.open:
            return self.clock() - self.opened_at >= self.reset_s
        return not self.trial_inflight

    def begin(self) -> None:
        if self.state is BreakerState.open and self.clock() - self.opened_at >= self.reset_s:
            self.state = BreakerState.half_open
        if self.state is BreakerState.half_open:
            self.trial_inflight = True

    def success(self) -> None:
        self.state, self.failures, self.trial_inflight = BreakerState.closed, 0, False

    def failure(self) -> None:
        self.failures += 1
        self.trial_inflight = False
        if self.state is BreakerState.half_open or self.failures >= self.failures_to_open:
            self.state, self.opened_at = BreakerState.open, self.clock()


def backend_metrics(name: str) -> tuple[Gauge, Counter, Histogram]:
    """A backend's in-flight, ok and latency children. Its error counts by every kind export 0
    from the start (metrics.zero says why)."""
    metrics.zero(metrics.INFERENCE_REQUESTS, *((name, kind.value) for kind in ErrorKind))
    return (
        metrics.INFERENCE_INFLIGHT.labels(name),
        metrics.INFERENCE_REQUESTS.labels(name, "ok"),
        metrics.INFERENCE_SECONDS.labels(name),
    )


@dataclass
class Slot:
    backend: Backend
    breaker: CircuitBreaker
    max_inflight: int
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        # The per-request metrics, labelled once: ``.labels()`` costs more than the update.
        self.m_inflight, self.m_ok, self.m_seconds = backend_metrics(self.name)

    @property
    def name(self) -> str:
        return self.backend.name

    def available(self) -> bool:
        return self.healthy and self.breaker.can_try() and self.outstanding < self.max_inflight


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: list[str], virtual_nodes: int = 64) -> None:
        points = sorted((_hash(f"{name}#{i}"), name) for name in names for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self._distinct = len(set(names))

    def walk(self, key: str) -> list[str]:
        """Backend names in ring order starting at ``key``'s position, each once."""
        if not self._names:
            return []
        i = bisect.bisect(self._hashes, _hash(key)) % len(self._names)
        seen: list[str] = []
        for j in range(len(self._names)):
            n = self._names[(i + j) % len(self._names)]
            if n not in seen:
                seen.append(n)
                if len(seen) == self._distinct:
                    break
        return seen


class Router:
    def __init__(
        self,
        backends: list[Backend],
        settings: InferenceSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # No backends is allowed: nothing has capacity, every request fails with the reason,
        # and the gateway's /health says so.
        self.settings = settings
        self.slots: dict[str, Slot] = {
            b.name: Slot(
                backend=b,
                breaker=CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s, clock),
                max_inflight=b.spec.max_inflight or settings.max_inflight_per_backend,
            )
            for b in backends
        }
        self.ring = HashRing(list(self.slots), settings.virtual_nodes)
        self._freed = asyncio.Condition()
        self._health_task: asyncio.Task[None] | None = None
        for s in self.slots.values():
            metrics.INFERENCE_BACKEND_HEALTHY.labels(s.name).set(1)

    # --- capacity and choice -----------------------------------------------------------------
    def has_capacity(self) -> bool:
        return any(s.available() for s in self.slots.values())

    def choose(
        self,
        episode_id: str | None,
        exclude: set[str] | frozenset[str] = frozenset(),
        among: Collection[str] | None = None,
    ) -> Slot | None:
        """A backend for a request: among ``among`` (default: all), not in ``exclude``
        unless nothing else is up."""
        slots = self.slots.values() if among is None else [self.slots[n] for n in among if n in self.slots]
        up = [s for s in slots if s.available()]
        candidates = [s for s in up if s.name not in exclude] or up
        if not candidates:
            return None
        if episode_id:
            total = sum(s.outstanding for s in self.slots.values())
            bound = math.ceil(self.settings.load_factor * (total + 1) / len(candidates))
            names = {s.name for s in candidates}
            for name in self.ring.walk(episode_id):
                s = self.slots[name]
                if name in names and s.outstanding + 1 <= bound:
                    return s
        low = min(s.outstanding for s in candidates)
        return random.choice([s for s in candidates if s.outstanding == low])

    def sticky_target(self, episode_id: str) -> str:
        """The backend an idle router would send ``episode_id`` to (for tests and debugging)."""
        return self.ring.walk(episode_id)[0]

    async def _wait_for_capacity(self, wait_s: float) -> None:
        async with self._freed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), wait_s)

    async def _release(self, slot: Slot) -> None:
        slot.outstanding -= 1
        slot.m_inflight.dec()
        async with self._freed:
            self._freed.notify_all()

    # --- one request ---------------------------------------------------------------------------
    async def generate(
        self, req: GenerateRequest, routes: Mapping[str, Serving] | None = None
    ) -> BackendResult:
        """Run ``req`` on a backend, retrying elsewhere; raises :class:`RequestFailed`.
        ``routes``: the backends that serve the request's job and how (the gateway's table
        of served versions); each attempt is sent with its backend's version and adapter."""
        if not self.slots:
            raise RequestFailed("no backend configured (TEMPER_INFERENCE__BACKENDS is empty)", 0)
        st = self.settings
        tried: set[str] = set()
        reason = "no attempt made"
        backend_error = ""  # the last backend's own error, kept when a later attempt finds none up
        attempts = 0
        deadline = time.monotonic() + st.request_timeout_s * (st.max_retries + 1)
        among = list(routes) if routes is not None else None
        pool = self.slots.values() if among is None else [self.slots[n] for n in among if n in self.slots]
        while attempts <= st.max_retries:
            slot = self.choose(req.episode_id, tried, among)
            if slot is None:
                if any(s.healthy and s.breaker.can_try() for s in pool):
                    # all usable backends are full: wait for a request to finish (backpressure)
                    if time.monotonic() > deadline:
                        reason = "timed out waiting for backend capacity"
                        break
                    await self._wait_for_capacity(0.05)
                    continue
                attempts += 1
                reason = "no backend available (all unhealthy or circuit open)" + backend_error
                if attempts <= st.max_retries:
                    await asyncio.sleep(self._backoff(attempts))
                continue
            attempts += 1
            slot.breaker.begin()
            slot.outstanding += 1
            slot.m_inflight.inc()
            t0 = time.perf_counter()
            if routes is not None:
                serving = routes[slot.name]
                req = replace(req, version=serving.version, adapter=serving.adapter)
            try:
                result = await slot.backend.complete(req)
            except BackendError as exc:
                slot.failed += 1
                metrics.INFERENCE_REQUESTS.labels(slot.name, exc.kind.value).inc()
                reason = f"{slot.name}: {exc}"
                backend_error = f"; before that {reason}"
                if not exc.retryable:
                    slot.breaker.success()  # the backend answered; the request is at fault
                    raise RequestFailed(reason, attempts) from exc
                if exc.kind is ErrorKind.not_served:
                    slot.breaker.success()  # it answered: the job's weights just are not there now
                else:
                    slot.breaker.failure()
                if exc.kind is ErrorKind.connect:
                    self._mark(slot, healthy=False)
                tried.add(slot.name)
                if attempts <= st.max_retries:
                    await asyncio.sleep(self._backoff(attempts))
                continue
            finally:
                await self._release(slot)
            elapsed = time.perf_counter() - t0
            slot.breaker.success()
            slot.served += 1
            slot.m_ok.inc()
            slot.m_seconds.observe(elapsed)
            return result
        raise RequestFailed(f"failed after {attempts} attempt(s): {reason}", attempts)

    def _backoff(self, attempt: int) -> float:
        base = self.settings.retry_backoff_s * (2 ** (attempt - 1))
        return base * (0.5 + random.random())

    # --- health ----------------------------------------------------------------------------------
    def _mark(self, slot: Slot, *, healthy: bool) -> None:
        slot.healthy = healthy
        metrics.INFERENCE_BACKEND_HEALTHY.labels(slot.name).set(1 if healthy else 0)

    async def check_health(self) -> dict[str, bool]:
        results = await asyncio.gather(*(s.backend.health() for s in self.slots.values()))
        for s, ok in zip(self.slots.values(), results, strict=True):
            self._mark(s, healthy=ok)
        async with self._freed:
            self._freed.notify_all()
        return {s.name: s.healthy for s in self.slots.values()}

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            with contextlib.suppress(Exception):
                await self.check_health()

    async def start(self, *, health_loop: bool = True) -> None:
        """Start the backends and probe them; ``health_loop=False`` leaves the periodic probe
        (:meth:`health_loop`) to the caller (the gateway component spawns it on its runtime)."""
        for s in self.slots.values():
            await s.backend.start()
        await self.check_health()
        if health_loop and self._health_task is None:
            self._health_task = asyncio.create_task(self.health_loop(), name="gateway-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for s in self.slots.values():
            await s.backend.aclose()

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "name": s.name,
                "url": s.backend.url,
                "healthy": s.healthy,
                "breaker": s.breaker.state.value,
                "outstanding": s.outstanding,
                "max_inflight": s.max_inflight,
                "served": s.served,
                "failed": s.failed,
            }
            for s in self.slots.values()
        ]
