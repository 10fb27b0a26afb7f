"""The gateway's logic, independent of HTTP and Kafka.

The bus handlers call :meth:`Inference.handle` for each ``inference.requests``
message and :meth:`Inference.apply_update` for each ``policy.updates`` message;
they pause the ``inference.requests`` partitions while :meth:`has_capacity` is false
and resume when it turns true again. The HTTP proxy (``app.py``) calls :meth:`generate`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from services.inference_gateway.backends import Backend, BackendResult, GenerateRequest, make_backend
from services.inference_gateway.checkpoints import fetch_checkpoint
from services.inference_gateway.router import RequestFailed, Router
from services.inference_gateway.sessions import ChatSessions
from services.inference_gateway.traces import InMemoryTraceStore, TraceStore
from temper import metrics
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate
from temper.policy import ChatTokenizer
from temper.policy.config import InferenceSettings
from temper.policy.tokenizer import policy_tokenizer
from temper.storage import ObjectStore

log = logging.getLogger(__name__)


class Inference:
    def __init__(
        self,
        settings: InferenceSettings,
        *,
        store: ObjectStore | None = None,
        traces: TraceStore | None = None,
        backends: list[Backend] | None = None,
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.traces = traces or InMemoryTraceStore()
        local_dirs = [b.model_dir for b in settings.backends if b.model_dir]
        self.tokenizer = tokenizer or policy_tokenizer(
            settings.model_name, local_dirs[0] if local_dirs else None
        )
        self.sessions = ChatSessions(self.tokenizer)
        if backends is None:
            backends = [
                make_backend(
                    spec,
                    model_name=settings.model_name,
                    timeout_s=settings.request_timeout_s,
                    connect_timeout_s=settings.connect_timeout_s,
                    vllm_reload_mode=settings.vllm_reload_mode,
                )
                for spec in settings.backends
            ]
        self.router = Router(backends, settings)
        self.policy_version = 0  # the newest version loaded, of any job
        self.versions: dict[str, int] = {}  # job -> the version its requests run on now
        self._update_lock = asyncio.Lock()
        self.last_switch_s: dict[str, float] = {}
        self.answered = 0  # requests answered on inference.results, for /v1/status
        self.failed = 0  # requests answered with an error

    async def start(self) -> None:
        await self.router.start()
        for s in self.router.slots.values():
            served = getattr(s.backend, "served_version", None)
            if served is not None:
                v = await served()
                if v is not None:
                    s.backend.version = v
        self.policy_version = max((s.backend.version for s in self.router.slots.values()), default=0)

    async def stop(self) -> None:
        await self.router.stop()

    # --- requests -------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        """False while every backend is full, down or open: pause consuming then."""
        return self.router.has_capacity()

    async def generate(self, req: GenerateRequest) -> BackendResult:
        """Route one request; raises :class:`RequestFailed` with the reason after the retry budget."""
        return await self.router.generate(req)

    async def handle(self, request: InferenceRequest) -> InferenceResult:
        """One ``inference.requests`` message to its ``inference.results`` message (never raises
        for backend trouble: a failure is a result with ``error`` set)."""
        envelope = {
            "job_id": request.job_id,
            "episode_id": request.episode_id,
            "turn": request.turn,
            "attempt": request.attempt,
        }
        req = GenerateRequest(
            prompt_ids=request.prompt_ids,
            sampling=request.sampling,
            episode_id=request.episode_id,
            request_id=str(request.id),
            job_id=request.job_id,
        )
        try:
            res = await self.router.generate(req)
        except RequestFailed as exc:
            return InferenceResult(
                **envelope, error=exc.reason, policy_version=self.job_version(request.job_id)
            )
        return InferenceResult(
            **envelope,
            token_ids=res.token_ids,
            logprobs=res.logprobs,
            text=res.text,
            finish_reason=res.finish_reason,
            policy_version=res.policy_version,
            backend=res.backend,
        )

    # --- weights --------------------------------------------------------------------------------
    async def apply_update(self, update: PolicyUpdate) -> dict[str, float]:
        """Switch every backend to ``update.version`` (idempotent; older versions are ignored).

        Requests already running finish on the old weights and report the old version;
        requests that start after a backend switched report the new one. Returns the
        switch time per backend in seconds.
        """
        return await self.reload(version=update.version, key=update.checkpoint_key, job_id=update.job_id)

    def job_version(self, job_id: str | None) -> int:
        """The version ``job_id``'s requests run on (every job's, before per-job versions)."""
        return self.versions.get(job_id, self.policy_version) if job_id else self.policy_version

    async def reload(
        self,
        *,
        version: int,
        key: str | None = None,
        path: str | Path | None = None,
        job_id: str | None = None,
    ) -> dict[str, float]:
        """Load ``version`` (of ``job_id``) on every backend that does not serve it yet. A
        backend counts as serving it only once its ``load_weights`` returned."""
        async with self._update_lock:

            def behind(b: Backend) -> bool:
                return (b.versions.get(job_id, b.version) if job_id else b.version) < version

            todo = [s for s in self.router.slots.values() if behind(s.backend)]
            if not todo:
                self._served(job_id, version)
                return {}
            local: Path | None = Path(path) if path else None
            if local is None and key is not None and self.store is not None:
                local = await fetch_checkpoint(self.store, key, self.settings.checkpoint_cache_dir, version)
            results = await asyncio.gather(
                *(s.backend.load_weights(version=version, path=local, key=key) for s in todo),
                return_exceptions=True,
            )
            times: dict[str, float] = {}
            for s, r in zip(todo, results, strict=True):
                if isinstance(r, BaseException):
                    log.error("backend %s failed to load version %s: %s", s.name, version, r)
                    continue
                times[s.name] = r
                if job_id:
                    s.backend.versions[job_id] = version
                metrics.WEIGHT_SWITCH_SECONDS.observe(r)
            if todo and not times:
                raise RuntimeError(f"no backend could load policy version {version}")
            self._served(job_id, version)
            self.last_switch_s.update(times)
            return times

    def _served(self, job_id: str | None, version: int) -> None:
        self.policy_version = max(self.policy_version, version)
        if job_id:
            self.versions[job_id] = max(self.versions.get(job_id, 0), version)

    def status(self) -> dict[str, Any]:
        return {
            "policy_version": self.policy_version,
            "job_versions": dict(self.versions),
            "has_capacity": self.has_capacity(),
            "backends": self.router.snapshot(),
            "time": time.time(),
        }
