"""Putting jobs' weights on the backends, and taking them off again.

One lock serialises every change (a version's load, a base change, a job's release);
after each change the backend is asked what it now serves and the table records that,
so the table only ever holds what a backend confirmed. The rules:

- A LoRA version goes on every backend that serves the job's base model in its pool (no
  job's full weights there); if none does, a free backend that can load models (the CPU
  runner) first takes the job's base.
- A full-weights version goes on the backend the job already holds, else on one it
  claims: a backend of its pool that no job holds, preferring one with no adapters and
  whose base is the job's; the adapters of other jobs there are unloaded first, and only
  if each of those jobs is still served elsewhere. A backend holds at most one job's full
  weights. With none to claim the version waits (:class:`Waiting`) until a job ends.
- A job that ended has its adapters unloaded and the backend it held put back on its base.
- A job's request that no backend serves may give a free backend the job's base model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.inference_gateway.backends import Backend, BackendError
from services.inference_gateway.checkpoints import fetch_checkpoint, fetch_model
from services.inference_gateway.router import Router
from services.inference_gateway.versions import JobModel, ServedVersions
from temper import faults, metrics, registry
from temper.events import PolicyUpdate
from temper.logs import log_event
from temper.policy.placement import origin_names
from temper.settings.inference import InferenceSettings
from temper.storage import NotFound, ObjectStore

log = logging.getLogger("services.inference_gateway")

Confirmed = Callable[[str, int, list[str]], Awaitable[None]]


class Waiting(RuntimeError):
    """A version that cannot be loaded now (no backend for it is free); ``reason`` says why."""


class Weights:
    def __init__(
        self,
        settings: InferenceSettings,
        router: Router,
        table: ServedVersions,
        jobs: dict[str, JobModel],
        store: ObjectStore | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.table = table
        self.jobs = jobs  # job -> its model, as its requests (or the database) say
        self.store = store
        self.on_confirmed: Confirmed | None = None  # a version every backend of its job serves
        self.changed = asyncio.Condition()  # notified after every change the table records
        self.last_switch_s: dict[str, float] = {}
        self._load_failed: dict[tuple[str, str], str] = {}  # (backend, model) -> last error, logged once
        self._lock = asyncio.Lock()

    def backend(self, name: str) -> Backend:
        return self.router.slots[name].backend

    async def refresh(self, names: list[str] | None = None) -> None:
        """Ask backends what they serve and record it (all of them by default)."""
        names = list(self.router.slots) if names is None else names
        reports = await asyncio.gather(*(self.backend(n).served() for n in names))
        for name, served in zip(names, reports, strict=True):
            self.table.record(name, served)
        async with self.changed:
            self.changed.notify_all()

    # --- versions ---------------------------------------------------------------------------
    async def apply(self, update: PolicyUpdate, *, path: Path | None = None) -> dict[str, float]:
        """Load ``update`` (fetched from its checkpoint key, or the local ``path``) where its
        job is served (see the module docstring); returns the switch time per backend.
        Idempotent: backends that serve it already are skipped. :class:`Waiting` when no
        backend can take it now; RuntimeError when every load failed."""
        async with self._lock:
            job = update.job_id or ""
            model = self.jobs.get(job)
            confirmed = self.table.confirmed(job, model)
            if confirmed is not None and confirmed >= update.version:
                await self._confirm(job, model, update.version)
                return {}
            path = path or await self._fetch(update)
            kind = _kind(path)
            if kind == "lora":
                todo = await self._lora_targets(job, model)
                if not todo:
                    pool = model.pool if model is not None else "default"
                    raise Waiting(
                        f"no backend of pool {pool!r} serves job {job!r}'s base model and none is free "
                        f"to take it ({self.table.describe(pool)})"
                    )
            else:
                todo = await self._full_target(job, model)
            todo = [
                n
                for n in todo
                if (s := self.table.serving(n, job, model)) is None or s.version < update.version
            ]
            if not todo:
                await self._confirm(job, model, update.version)
                return {}
            await faults.hold("gateway.load", job_id=job, version=update.version)
            results = await asyncio.gather(
                *(
                    self.backend(n).load_weights(
                        version=update.version, path=path, key=update.checkpoint_key, job_id=job
                    )
                    for n in todo
                ),
                return_exceptions=True,
            )
            await self.refresh(todo)
            times: dict[str, float] = {}
            last_error: BaseException | None = None
            for name, r in zip(todo, results, strict=True):
                if isinstance(r, BaseException):
                    log_event(
                        log,
                        "backend failed to load a version",
                        logging.ERROR,
                        backend=name,
                        job_id=job,
                        version=update.version,
                        error=repr(r)[:300],
                    )
                    last_error = r
                    continue
                times[name] = r
                metrics.WEIGHT_SWITCH_SECONDS.observe(r)
            if not times:
                raise RuntimeError(
                    f"no backend could load version {update.version} of job {job!r}: {last_error!r}"[:500]
                )
            self.last_switch_s.update(times)
            await self._confirm(job, model, update.version)
            return times

    async def _confirm(self, job: str, model: JobModel | None, version: int) -> None:
        routes = self.table.routes(job, model)
        if routes and min(s.version for s in routes.values()) >= version and self.on_confirmed is not None:
            await self.on_confirmed(job, version, sorted(routes))

    async def _fetch(self, update: PolicyUpdate) -> Path:
        key = update.checkpoint_key
        if self.store is None:
            raise RuntimeError(f"no object store to fetch {key}")
        return await fetch_checkpoint(self.store, key, self.settings.checkpoint_cache_dir, update.version)

    async def _lora_targets(self, job: str, model: JobModel | None) -> list[str]:
        routes = [n for n in self.table.routes(job, model) if self.table.holdings[n].owner is None]
        if routes or model is None:
            return routes
        placed = await self._place_base(job, model)
        return [placed] if placed else []

    async def _full_target(self, job: str, model: JobModel | None) -> list[str]:
        owned = self.table.owned_by(job)
        if owned:
            return owned
        pool = model.pool if model is not None else "default"
        name = self._claimable(job, model, pool)
        if name is None:
            raise Waiting(
                f"no backend of pool {pool!r} is free for job {job!r}'s full weights "
                f"({self.table.describe(pool)})"
            )
        h = self.table.holdings[name]
        for other in sorted(h.adapters):  # served elsewhere too: _claimable checked it
            await self.backend(name).release(other)
        if h.adapters:
            await self.refresh([name])
        return [name]

    def _claimable(self, job: str, model: JobModel | None, pool: str) -> str | None:
        """A backend ``job`` may take for its full weights, or None."""
        best: tuple[int, str] | None = None
        for name in self.table.in_pool(pool):
            h = self.table.holdings[name]
            if not h.known or h.owner is not None:
                continue
            same_base = model is None or model.base in h.names
            if not same_base and not self.backend(name).loads_models:
                continue
            if self._strands(name, job):
                continue
            rank = (0 if not h.adapters else 2) + (0 if same_base else 1)
            if best is None or rank < best[0]:
                best = (rank, name)
        return best[1] if best else None

    def _strands(self, name: str, job: str) -> bool:
        """Would taking ``name`` leave a live job (other than ``job``) with no backend?"""
        for other, model in self.jobs.items():
            if other == job:
                continue
            routes = self.table.routes(other, model)
            if name in routes and len(routes) == 1:
                return True
        return False

    async def place_base(self, job: str, model: JobModel) -> bool:
        """Give a free backend ``job``'s base model, so that its requests have somewhere to
        run; True when one serves it now."""
        async with self._lock:
            if self.table.routes(job, model):
                return True
            return await self._place_base(job, model) is not None

    async def _place_base(self, job: str, model: JobModel) -> str | None:
        for name in self.table.free(model.pool):
            backend = self.backend(name)
            if not backend.loads_models or self._strands(name, job):
                continue
            own = model.base in origin_names(backend.spec, self.settings.model_name)
            t0 = time.perf_counter()
            try:
                directory = (
                    None  # its own weights again
                    if own
                    else await fetch_model(self.store, model.base, self.settings.checkpoint_cache_dir)
                )
                await backend.load_base(model.base, directory)
            except (BackendError, NotFound, OSError, ValueError) as exc:
                if self._load_failed.get((name, model.base)) != repr(exc):
                    log_event(
                        log,
                        "cannot load a job's model",
                        logging.WARNING,
                        backend=name,
                        job_id=job,
                        model=model.base,
                        error=repr(exc)[:300],
                    )
                self._load_failed[(name, model.base)] = repr(exc)
                continue
            finally:
                await self.refresh([name])
            log_event(
                log,
                "backend base model changed",
                backend=name,
                job_id=job,
                model=model.base,
                switch_ms=round((time.perf_counter() - t0) * 1000, 3),
            )
            return name
        return None

    # --- ends ---------------------------------------------------------------------------------
    async def release(self, job: str) -> list[str]:
        """``job`` ended: unload its adapters and put back the base where it held full
        weights. Returns the backends that changed."""
        async with self._lock:
            self.jobs.pop(job, None)
            names = self.table.holders_of(job)
            for name in names:
                try:
                    await self.backend(name).release(job)
                except BackendError as exc:
                    log_event(
                        log,
                        "backend failed to release a job",
                        logging.ERROR,
                        backend=name,
                        job_id=job,
                        error=repr(exc)[:300],
                    )
            if names:
                await self.refresh(names)
                log_event(log, "job released", job_id=job, backends=names)
            return names


def _kind(path: Path) -> str:
    """``lora`` or ``full``: what a fetched version is (a bare weights file is full)."""
    manifest = path / registry.MANIFEST_FILE
    if path.is_dir() and manifest.is_file():  # checked against its files when it was fetched
        return registry.Manifest.model_validate_json(manifest.read_text()).kind
    return "full"
