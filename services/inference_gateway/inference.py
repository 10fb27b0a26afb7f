"""The gateway's inference, independent of HTTP and Kafka: each request is routed to a
backend that serves its job (``versions.py`` says which) and answered with the version that
backend ran it on; policy updates and job ends change the weights (``weights.py``).

The bus handlers call :meth:`Inference.handle` for each ``inference.requests`` message;
they pause the ``inference.requests`` partitions while :meth:`has_capacity` is false and
resume when it turns true again. The HTTP proxy (``routes.py``) calls :meth:`generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.inference_gateway.backends import Backend, BackendResult, CpuServerBackend, GenerateRequest
from services.inference_gateway.router import RequestFailed, Router
from services.inference_gateway.sessions import ChatSessions
from services.inference_gateway.traces import InMemoryTraceStore, TraceStore
from services.inference_gateway.versions import JobModel, ServedVersions
from services.inference_gateway.vllm_backend import VLLMBackend
from services.inference_gateway.weights import Weights
from temper import faults
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate
from temper.policy import ChatTokenizer
from temper.policy.tokenizer import policy_tokenizer
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings, VLLMReloadMode
from temper.storage import ObjectStore


def make_backend(
    spec: BackendSpec,
    *,
    model_name: str,
    timeout_s: float,
    connect_timeout_s: float,
    vllm_reload_mode: VLLMReloadMode = VLLMReloadMode.lora,
) -> Backend:
    if spec.kind is BackendKind.local:
        from services.inference_gateway.local import LocalBackend  # torch is imported only when needed

        return LocalBackend(spec, model_name=model_name)
    kw: dict[str, Any] = {
        "model_name": model_name,
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
    }
    if spec.kind is BackendKind.vllm:
        return VLLMBackend(spec, reload_mode=vllm_reload_mode, **kw)
    return CpuServerBackend(spec, **kw)


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
        self.table = ServedVersions(backends, model_name=settings.model_name)
        self.jobs: dict[str, JobModel] = {}  # job -> its model, from its requests (or the database)
        self.weights = Weights(settings, self.router, self.table, self.jobs, store)
        # Called when a job's request finds no backend: the owner of job ends (the database)
        # can look for a finished job holding one, before the request waits on.
        self.on_blocked: Callable[[], Awaitable[None]] | None = None
        self.answered = 0  # requests answered on inference.results, for /v1/status
        self.failed = 0  # requests answered with an error

    @property
    def store(self) -> ObjectStore | None:
        return self.weights.store

    @store.setter
    def store(self, store: ObjectStore | None) -> None:
        self.weights.store = store

    async def start(self, *, health_loop: bool = True) -> None:
        """Start the backends and record what each serves (``health_loop``: see Router.start)."""
        await self.router.start(health_loop=health_loop)
        await self.weights.refresh()

    async def stop(self) -> None:
        await self.router.stop()

    # --- requests -------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        """False while every backend is full, down or open: pause consuming then."""
        return self.router.has_capacity()

    def confirmed(self, job_id: str | None) -> int | None:
        """The version every backend serving ``job_id`` confirmed, None when none serves it."""
        return self.table.confirmed(job_id, self.jobs.get(job_id or ""))

    async def generate(self, req: GenerateRequest, model: JobModel | None = None) -> BackendResult:
        """Run ``req`` on a backend that serves its job, waiting (up to the request timeout)
        while none does; raises :class:`RequestFailed` with the reason."""
        job = req.job_id or ""
        model = model or self.jobs.get(job)
        deadline = time.monotonic() + self.settings.request_timeout_s
        while True:
            routes = self.table.routes(req.job_id, model)
            if routes or not self.router.slots:  # none configured: the router says so at once
                return await self.router.generate(req, routes)
            if model is not None and await self.weights.place_base(job, model):
                continue
            if self.on_blocked is not None:
                await self.on_blocked()
                if self.table.routes(req.job_id, model):
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                pool = model.pool if model is not None else "default"
                wanted = f"model {model.base!r} " if model is not None else ""
                raise RequestFailed(
                    f"no backend serves job {job!r} ({wanted}in pool {pool!r}): {self.table.describe(pool)}",
                    0,
                )
            async with self.weights.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.weights.changed.wait(), min(left, 0.5))

    async def handle(self, request: InferenceRequest) -> InferenceResult:
        """One ``inference.requests`` message to its ``inference.results`` message (never raises
        for backend trouble: a failure is a result with ``error`` set)."""
        envelope = {
            "job_id": request.job_id,
            "episode_id": request.episode_id,
            "turn": request.turn,
            "attempt": request.attempt,
        }
        model = JobModel(base=request.init or request.model, pool=request.pool)
        if request.job_id:
            self.jobs[request.job_id] = model
        req = GenerateRequest(
            prompt_ids=request.prompt_ids,
            sampling=request.sampling,
            episode_id=request.episode_id,
            request_id=str(request.id),
            job_id=request.job_id,
            partial_rollout=request.partial_rollout,
        )
        try:
            res = await self.generate(req, model)
        except RequestFailed as exc:
            # the version the job's backends confirmed, never another job's
            return InferenceResult(
                **envelope, error=exc.reason, policy_version=self.confirmed(request.job_id) or 0
            )
        await faults.hold("gateway.generate", episode_id=request.episode_id, turn=request.turn)
        return InferenceResult(
            **envelope,
            token_ids=res.token_ids,
            logprobs=res.logprobs,
            token_versions=res.versions(),
            text=res.text,
            finish_reason=res.finish_reason,
            policy_version=res.policy_version,
            backend=res.backend,
        )

    # --- weights --------------------------------------------------------------------------------
    async def apply_update(self, update: PolicyUpdate, *, path: Path | None = None) -> dict[str, float]:
        """Load ``update`` where its job is served (``weights.py``); returns the switch time
        per backend (empty when every backend serving the job has it already). A job whose
        full weights find no free backend raises :class:`Waiting`."""
        return await self.weights.apply(update, path=path)

    async def end_job(self, job_id: str) -> list[str]:
        """A job ended: its weights leave the backends (``weights.py``)."""
        return await self.weights.release(job_id)

    def status(self) -> dict[str, Any]:
        return {
            "job_versions": {
                job: self.confirmed(job) for job in sorted(self.jobs.keys() | self.table.jobs())
            },
            "served": self.table.snapshot(),
            "has_capacity": self.has_capacity(),
            "backends": self.router.snapshot(),
            "time": time.time(),
        }
