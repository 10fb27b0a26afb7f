"""The ``local`` backend: the CPU model runner inside the gateway process, without HTTP.

Embedded mode (``temper run``, ``temper serve``) uses it when no backend is configured,
and a distributed gateway can name it (``{"name": "local-0", "kind": "local"}``) to serve
a small model itself. It batches concurrent requests with the runner's
:class:`BatchScheduler`, and loads, releases and changes weights between batches the same
way the CPU model server does; each result's version is the one the runner really ran it
on, and what it serves is what the runner holds (:meth:`served`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.inference_gateway.backends import (
    Backend,
    BackendError,
    BackendResult,
    ErrorKind,
    GenerateRequest,
    Served,
)
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import (
    GenRequest,
    ModelRunner,
    NotServed,
    SamplingParams,
    build_runner,
)
from temper.settings.inference import BackendSpec


class LocalBackend(Backend):
    loads_models = True

    def __init__(self, spec: BackendSpec, *, model_name: str, runner: ModelRunner | None = None) -> None:
        # No HTTP client: this backend never leaves the process.
        self.spec = spec
        self.name = spec.name
        self.url = f"local://{spec.name}"
        self.model_name = spec.model or model_name
        self.runner = runner
        self.scheduler: BatchScheduler | None = None

    async def start(self) -> None:
        if self.scheduler is not None:
            return
        if self.runner is None:
            spec = self.spec
            self.runner = await asyncio.to_thread(
                build_runner, model_dir=spec.model_dir, preset=spec.preset, seed=spec.seed
            )
        self.scheduler = BatchScheduler(
            self.runner, max_batch=self.spec.max_batch, window_ms=self.spec.batch_window_ms
        )
        await self.scheduler.start()

    def _started(self) -> tuple[BatchScheduler, ModelRunner]:
        if self.scheduler is None or self.runner is None:
            raise BackendError(ErrorKind.connect, f"{self.name}: local runner not started")
        return self.scheduler, self.runner

    async def complete(self, req: GenerateRequest) -> BackendResult:
        sched, runner = self._started()
        ids = req.prompt_ids
        vocab = runner.tok.vocab_size
        if not ids:
            raise BackendError(ErrorKind.client, f"{self.name}: prompt is empty", status=400)
        if min(ids) < 0 or max(ids) >= vocab:
            raise BackendError(
                ErrorKind.client, f"{self.name}: prompt token ids must be in [0, {vocab})", status=400
            )
        if len(ids) >= runner.max_len:
            raise BackendError(
                ErrorKind.client,
                f"{self.name}: prompt of {len(ids)} tokens exceeds {runner.max_len}",
                status=400,
            )
        s = req.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=req.ignore_eos,
        )
        try:
            out = await sched.submit(
                GenRequest(list(ids), params, job_id=req.job_id, partial_rollout=req.partial_rollout)
            )
        except asyncio.CancelledError:
            raise
        except NotServed as exc:
            raise BackendError(ErrorKind.not_served, f"{self.name}: {exc}", status=409) from exc
        except Exception as exc:  # noqa: BLE001 - a failed batch is the backend's fault: retryable
            raise BackendError(ErrorKind.server, f"{self.name}: {type(exc).__name__}: {exc}") from exc
        return BackendResult(
            prompt_ids=out.prompt_ids,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            text=out.text,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            policy_version=out.policy_version,
            backend=self.name,
            token_versions=out.token_versions,
        )

    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        sched, _ = self._started()
        if path is None:
            raise BackendError(
                ErrorKind.client, f"{self.name}: a local reload needs the fetched checkpoint file"
            )
        try:
            return await sched.reload(path, version, job_id)
        except NotServed as exc:
            raise BackendError(ErrorKind.not_served, f"{self.name}: {exc}", status=409) from exc

    async def load_base(self, name: str, path: Path | None) -> float:
        sched, _ = self._started()
        try:
            return await sched.load_base(path, name)
        except NotServed as exc:
            raise BackendError(ErrorKind.not_served, f"{self.name}: {exc}", status=409) from exc

    async def release(self, job_id: str) -> float:
        sched, _ = self._started()
        return await sched.release(job_id)

    async def served(self) -> Served | None:
        if self.runner is None:
            return None
        h = self.runner.holding()
        return Served(
            base=h.base, at_origin=h.at_origin, owner=h.owner, version=h.version, adapters=h.adapters
        )

    async def health(self) -> bool:
        return self.scheduler is not None and self.scheduler.running

    async def aclose(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
            self.scheduler = None
