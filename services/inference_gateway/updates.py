"""Policy updates onto the backends, and what the database says about the jobs.

- ``policy.updates`` (group ``TEMPER_INFERENCE__POLICY_GROUP``, else
  ``inference-gateway-<uuid>``, one per replica so every replica sees every update).
  Updates are coalesced per job: only a job's newest version waits to be loaded (a replay
  of v1..v9 loads v9 once), and a version at or below what the job's backends confirmed
  is ignored. Another job's versions never count.
- A version that cannot be loaded now (a job's full weights and no free backend) waits,
  and is tried again whenever a job ends or a backend reports a change.
- A version whose load failed (its checkpoint unreadable: the object store refusing) stays
  wanted and is tried again by the watch, at growing intervals (``RETRY_MAX_S`` at most):
  the dispatcher waits for it before the job's next iteration, so no newer version would
  come to replace it, and dropping it stopped the job for good.
- Once every backend serving a job confirmed a version, its ``policy_versions`` row gets
  ``served_at`` and ``served_by``: the dispatcher starts iterations on that. A write that
  fails (the database restarting) is tried again by the watch until it lands: a loaded
  version is confirmed once, and without its row the job would wait forever.
- The current policy at start: before it takes a request, a gateway reads the running jobs
  and the newest published version of each from the database, so a restarted replica
  never serves version 0 (or whatever its policy group would replay) while the trainer is
  at v22. Without a database it goes by the updates it reads.
- The watch asks every backend what it serves, every ``health_interval_s``: a backend that
  restarted (back at its initial weights) is seen and given its jobs' versions again, and
  jobs the database says have ended are released (their adapters unloaded, the base put
  back where their full weights were).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy import update as sql_update

from services.inference_gateway.inference import Inference
from services.inference_gateway.versions import JobModel
from services.inference_gateway.weights import Waiting
from temper.clock import utcnow
from temper.db import Database, InferenceBackend, Job, PolicyVersion
from temper.events import PolicyUpdate
from temper.jobspec import OFFLINE_DATA
from temper.lifecycle import JOB_TERMINAL
from temper.logs import log_event
from temper.policy.placement import backend_info
from temper.runtime import Runtime
from temper.settings import Mode

log = logging.getLogger("services.inference_gateway")

OFFLINE_NAMES = {a.value for a in OFFLINE_DATA}
ENDED_KEPT = 10_000  # ended jobs remembered, so that their late updates are not loaded
BLOCKED_CHECK_S = 0.25  # a request that finds no backend asks the database at most this often
RETRY_FIRST_S = 2.0  # a failed version is tried again after this, doubled each failed round
RETRY_MAX_S = 15.0  # a job waits on it: a store back from refusing is seen within this


class PolicyUpdates:
    """The versions wanted per job and the loop that loads them; the current versions at
    start; the watch; the record of confirmed versions on their rows."""

    def __init__(self, runtime: Runtime, inference: Inference, *, retries: int = 3) -> None:
        self.runtime = runtime
        self.inference = inference
        self.retries = retries
        self.wanted: dict[str, PolicyUpdate] = {}  # job -> its newest version
        self.waiting: dict[str, str] = {}  # job -> why its version cannot be loaded now
        self.ended: OrderedDict[str, None] = OrderedDict()  # jobs released: a late update is ignored
        self.retry_at: dict[str, tuple[float, float]] = {}  # job -> (when, interval) of a failed load
        self.unrecorded: dict[str, tuple[int, list[str]]] = {}  # job -> confirmed, row not written
        self._ready = asyncio.Event()
        self._db: Database | None = None
        self._own_db = False
        self._checked_at = 0.0
        self.updates_applied = 0
        self.update_errors = 0
        inference.weights.on_confirmed = self.record_served
        inference.on_blocked = self.check_blocked

    # --- the database -------------------------------------------------------------------------
    def database(self) -> Database | None:
        """The runtime's database, else the configured shared one (opened once), else None."""
        if self.runtime.db is not None:
            return self.runtime.db
        if self._db is None:
            settings = self.runtime.settings
            if settings.mode is not Mode.distributed or settings.db.url.startswith("sqlite"):
                return None  # no shared database to ask: the updates it reads will do
            self._db, self._own_db = Database(settings.db), True
        return self._db

    async def close(self) -> None:
        if self._own_db and self._db is not None:
            await self._db.dispose()
        self._db = None

    async def record_backends(self) -> None:
        """Write what each backend can serve (``inference_backends``), for the dispatcher's
        checks; rows of backends this gateway does not have are removed (the replicas of a
        gateway share one list)."""
        db = self.database()
        if db is None:
            return
        settings = self.inference.settings
        infos = [backend_info(slot.backend.spec, settings) for slot in self.inference.router.slots.values()]
        async with db.session() as s:
            await s.execute(
                delete(InferenceBackend).where(InferenceBackend.name.not_in([i.name for i in infos]))
            )
            for info in infos:
                row = await s.get(InferenceBackend, info.name) or InferenceBackend(name=info.name)
                row.pool, row.kind, row.loads_models = info.pool, info.kind, info.loads_models
                row.models, row.weights = sorted(info.models), sorted(info.weights)
                row.updated_at = utcnow()
                s.add(row)

    async def record_served(self, job: str, version: int, backends: list[str]) -> None:
        db = self.database()
        if db is None or not job:
            return
        try:
            async with db.session() as s:
                await s.execute(
                    sql_update(PolicyVersion)
                    .where(
                        PolicyVersion.job_id == job,
                        PolicyVersion.version == version,
                        PolicyVersion.served_at.is_(None),
                    )
                    .values(served_at=utcnow(), served_by=backends)
                )
        except Exception as exc:  # noqa: BLE001 - the watch writes it again
            kept = self.unrecorded.get(job)
            if kept is None or kept[0] <= version:
                self.unrecorded[job] = (version, backends)
            log_event(
                log,
                "cannot record a served version",
                logging.WARNING,
                job_id=job,
                version=version,
                error=repr(exc),
            )
            return
        self.runtime.notify_version_served()
        kept = self.unrecorded.get(job)
        if kept is not None and kept[0] <= version:
            del self.unrecorded[job]
            if kept[0] == version:
                log_event(log, "served version recorded after a failed write", job_id=job, version=version)

    async def record_unrecorded(self) -> None:
        """Write again the confirmed versions whose rows a failed write left without
        ``served_at`` (an older version of a job is still written: its row is what tells the
        dispatcher the gateway got there)."""
        for job, (version, backends) in list(self.unrecorded.items()):
            if job in self.ended:
                self.unrecorded.pop(job, None)
                continue
            await self.record_served(job, version, backends)

    async def current_policies(self) -> list[PolicyUpdate]:
        """The newest published version of every job that is not finished, oldest first;
        each job's model is noted for routing."""
        db = self.database()
        if db is None:
            return []
        async with db.session() as s:
            jobs = {
                job.id: job
                for job in (
                    await s.execute(select(Job).where(Job.state.not_in(list(JOB_TERMINAL))))
                ).scalars()
                # a job without episodes (sft, dpo, reward_model) is served nothing
                if ((job.spec or {}).get("algorithm") or {}).get("name") not in OFFLINE_NAMES
            }
            rows = (
                await s.execute(
                    select(PolicyVersion)
                    .where(PolicyVersion.job_id.in_(list(jobs)))
                    .order_by(PolicyVersion.created_at, PolicyVersion.version)
                )
            ).scalars()
            newest = {row.job_id: row for row in rows}  # the last row of a job is its newest
        for job in jobs.values():
            model = model_of(job.spec)
            if model is not None:
                self.inference.jobs.setdefault(job.id, model)
        ordered = sorted(newest.values(), key=lambda r: (r.created_at, r.version))
        return [
            PolicyUpdate(job_id=r.job_id, version=r.version, checkpoint_key=r.checkpoint_key, step=r.step)
            for r in ordered
        ]

    async def know_job(self, job: str) -> None:
        """Note ``job``'s model and pool from its spec in the database when no request of it has
        told them yet: an evaluation job's version comes before its first request, and its
        weights must go where its model and pool are served."""
        db = self.database()
        if not job or job in self.inference.jobs or db is None:
            return
        async with db.session() as s:
            spec = await s.scalar(select(Job.spec).where(Job.id == job))
        model = model_of(spec)
        if model is not None:
            self.inference.jobs.setdefault(job, model)

    async def ended_jobs(self) -> set[str]:
        """Of the jobs something is loaded or wanted for, those the database says ended (a
        job it does not know is not judged: its rows may be elsewhere)."""
        db = self.database()
        inference = self.inference
        jobs = (inference.table.jobs() | set(inference.jobs) | set(self.wanted)) - {""}
        if db is None or not jobs:
            return set()
        async with db.session() as s:
            query = select(Job.id).where(Job.id.in_(list(jobs)), Job.state.in_(list(JOB_TERMINAL)))
            return set((await s.execute(query)).scalars())

    async def release_ended(self) -> list[str]:
        try:
            ended = await self.ended_jobs()
        except Exception as exc:  # noqa: BLE001 - released on a later check
            log_event(log, "cannot read which jobs ended", logging.WARNING, error=repr(exc)[:300])
            return []
        for job in sorted(ended):
            self.wanted.pop(job, None)
            self.waiting.pop(job, None)
            self.retry_at.pop(job, None)
            self.ended[job] = None
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
            await self.inference.end_job(job)
        if ended:
            self._ready.set()  # a freed backend may take a waiting version
        return sorted(ended)

    async def check_blocked(self) -> None:
        """A request found no backend for its job: see whether a job holding one ended."""
        now = time.monotonic()
        if now - self._checked_at < BLOCKED_CHECK_S:
            return
        self._checked_at = now
        await self.release_ended()

    # --- updates ------------------------------------------------------------------------------
    def behind(self, update: PolicyUpdate) -> bool:
        confirmed = self.inference.confirmed(update.job_id)
        return confirmed is None or confirmed < update.version

    def offer(self, message: PolicyUpdate) -> None:
        """Keep ``message`` as its job's wanted version unless a newer one is, or its backends
        serve it already."""
        job = message.job_id or ""
        if job in self.ended:
            return  # a version the trainer published as its job ended: nobody will ask for it
        current = self.wanted.get(job)
        if current is not None and current.version >= message.version:
            return
        if current is None and not self.behind(message):
            return  # already served (or older): idempotent
        self.wanted[job] = message
        self.retry_at.pop(job, None)  # a newer version is tried at once
        self._ready.set()

    async def load_current(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                await self.record_backends()
                current = await self.current_policies()
                for update in current:
                    self.offer(update)
                await self.release_ended()
                await self.apply_wanted()
                # Said once, so a restart shows which versions it came back on.
                log_event(
                    log,
                    "policy version loaded at start",
                    versions={u.job_id: u.version for u in current},
                )
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - serve what the updates bring rather than not start
                log_event(
                    log,
                    "cannot load the current policy versions at start",
                    logging.WARNING,
                    attempt=attempt,
                    error=repr(exc)[:300],
                )
                if attempt < attempts:
                    await asyncio.sleep(0.5 * attempt)

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.apply_wanted()

    async def apply_wanted(self) -> None:
        now = time.monotonic()
        for job, update in list(self.wanted.items()):
            if job in self.retry_at and self.retry_at[job][0] > now:
                continue  # failed lately: the watch tries it again when its time comes
            if self.wanted.get(job) is update and self.behind(update):
                await self._apply_one(update)

    def retry_due(self) -> bool:
        now = time.monotonic()
        return any(when <= now for when, _ in self.retry_at.values())

    async def _apply_one(self, update: PolicyUpdate) -> None:
        """Apply one job's wanted version, retried; a newer one queued meanwhile wins."""
        job = update.job_id or ""
        for attempt in range(1, self.retries + 1):
            try:
                await self.know_job(job)
                times = await self.inference.apply_update(update)
            except asyncio.CancelledError:
                raise
            except Waiting as exc:
                if self.waiting.get(job) != str(exc):
                    log_event(
                        log,
                        "policy version waits for a backend",
                        job_id=job,
                        version=update.version,
                        reason=str(exc),
                    )
                self.waiting[job] = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a bad checkpoint must not stop the gateway
                newer = self.wanted.get(job) is not update
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
                    if not newer:  # kept: it serves what it has until this loads or a newer comes
                        interval = min(RETRY_MAX_S, self.retry_at.get(job, (0.0, RETRY_FIRST_S / 2))[1] * 2)
                        self.retry_at[job] = (time.monotonic() + interval, interval)
                        log_event(
                            log,
                            "policy version tried again later",
                            logging.WARNING,
                            job_id=job,
                            version=update.version,
                            retry_in_s=interval,
                        )
                    return
                await asyncio.sleep(0.5 * attempt)
                continue
            self.waiting.pop(job, None)
            self.retry_at.pop(job, None)
            self.updates_applied += 1
            log_event(
                log,
                "policy version switched",
                version=update.version,
                job_id=job,
                switch_ms={k: round(v * 1000, 3) for k, v in times.items()},
            )
            return

    async def watch(self) -> None:
        """Every ``health_interval_s``: what each backend serves (a restarted one is given
        its jobs' versions again), and which jobs ended."""
        interval = max(0.5, self.inference.settings.health_interval_s)
        while True:
            await asyncio.sleep(interval)
            await self.inference.weights.refresh()
            await self.release_ended()
            await self.record_unrecorded()
            behind = sorted(
                j
                for j, u in self.wanted.items()
                if self.behind(u) and j not in self.waiting and j not in self.retry_at
            )
            if behind:
                log_event(log, "a job's backends are behind its version; loading it", jobs=behind)
            if behind or self.waiting or self.retry_due():
                self._ready.set()


def model_of(spec: dict[str, Any] | None) -> JobModel | None:
    """What a stored job spec is served with: the model it starts from and its pool."""
    policy = (spec or {}).get("policy") or {}
    if not policy.get("model"):
        return None
    return JobModel(base=policy.get("init") or policy["model"], pool=policy.get("backend_pool", "default"))
