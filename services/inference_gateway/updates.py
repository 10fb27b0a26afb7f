"""Policy updates onto the backends.

- ``policy.updates`` (group ``TEMPER_INFERENCE__POLICY_GROUP``, else
  ``inference-gateway-<uuid>``, one per replica so every replica sees every update).
  Updates are coalesced: only the newest pending version is loaded (a replay of v1..v9
  loads v9 once), and versions at or below the served one are ignored.
- The current policy at start: before it takes a request, a gateway loads the newest
  published version of the running jobs from the database (``policy_versions``), so a
  restarted replica never serves version 0 (or whatever its policy group would replay)
  while the trainer is at v22. Without a database it falls back to the updates it reads.
- A backend that restarted (an engine server back at its initial weights) is noticed by
  the version watch (``served_version`` below the gateway's) and reloaded with the
  current version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import select

from services.inference_gateway.inference import Inference
from temper.db import Database, Job, PolicyVersion
from temper.events import PolicyUpdate
from temper.lifecycle import JobState
from temper.logs import log_event
from temper.runtime import Runtime
from temper.settings import Mode

log = logging.getLogger("services.inference_gateway")


class PolicyUpdates:
    """The updates waiting to be loaded (one per job, the newest) and the loop that loads
    them; the current versions at start; the watch that reloads a restarted backend."""

    def __init__(self, runtime: Runtime, inference: Inference, *, retries: int = 3) -> None:
        self.runtime = runtime
        self.inference = inference
        self.retries = retries
        self._pending: dict[str, PolicyUpdate] = {}  # job -> newest update not applied yet
        self._current: PolicyUpdate | None = None  # the version served, for the version watch
        self._ready = asyncio.Event()
        self.updates_applied = 0
        self.update_errors = 0

    def offer(self, message: PolicyUpdate) -> None:
        """Queue ``message`` unless its job already serves it; only the newest waits."""
        if message.version <= self.inference.job_version(message.job_id):
            return  # already served (or older): idempotent
        pending = self._pending.get(message.job_id or "")
        if pending is None or message.version > pending.version:
            self._pending[message.job_id or ""] = message
            self._ready.set()

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

    async def load_current(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                for current in await self.current_policies():
                    if current.version > self.inference.job_version(current.job_id):
                        await self.inference.apply_update(current)
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

    async def watch(self) -> None:
        """Reload a backend that serves less than the gateway's version (it restarted)."""
        interval = max(0.5, self.inference.settings.health_interval_s)
        while True:
            await asyncio.sleep(interval)
            current = self._current
            if current is None or current.version != self.inference.policy_version:
                continue
            behind = False
            for slot in self.inference.router.slots.values():
                probe = getattr(slot.backend, "served_version", None)
                served = await probe() if probe is not None else None
                if served is not None and served < current.version:
                    slot.backend.version = served
                    behind = True
            if behind:
                log_event(log, "a backend restarted behind; reloading it", version=current.version)
                with contextlib.suppress(Exception):
                    await self.inference.apply_update(current)

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                _, update = self._pending.popitem()
                if update.version > self.inference.job_version(update.job_id):
                    await self._apply_one(update)

    async def _apply_one(self, update: PolicyUpdate) -> None:
        """Apply one job's newest update, retried; a newer one queued meanwhile wins."""
        for attempt in range(1, self.retries + 1):
            try:
                times = await self.inference.apply_update(update)
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
                if newer or attempt == self.retries:
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
