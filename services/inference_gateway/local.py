"""The ``local`` backend: the CPU model runner inside the gateway process, without HTTP.

Embedded mode (``temper run``) uses it when no backend is configured, and a distributed
gateway can name it (``{"name": "local-0", "kind": "local"}``) to serve a small model
itself. It batches concurrent requests with the runner's :class:`BatchScheduler`, and
switches weights on policy updates the same way the CPU model server does: the running
batch finishes on the old weights, the next one runs on the new version. Versions from
the registry that are LoRA adapters become their job's adapter (requests carry
``job_id``), so many jobs share the one base model; each result's version is the one the
runner really ran it on.
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
)
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import (
    GenRequest,
    ModelRunner,
    SamplingParams,
)
from temper.policy.config import BackendSpec


def build_runner(spec: BackendSpec) -> ModelRunner:
    """The runner a local backend spec names: a model directory, or a preset with seeded random weights."""
    from temper.policy import create_model, default_tokenizer, load_model, read_metadata

    if spec.model_dir:
        model, tok = load_model(spec.model_dir)
        return ModelRunner(model, tok, version=int(read_metadata(spec.model_dir).get("version", 0)))
    return ModelRunner(create_model(spec.preset, seed=spec.seed), default_tokenizer(), version=0)


class LocalBackend(Backend):
    def __init__(self, spec: BackendSpec, *, model_name: str, runner: ModelRunner | None = None) -> None:
        # No HTTP client: this backend never leaves the process.
        self.spec = spec
        self.name = spec.name
        self.url = f"local://{spec.name}"
        self.model_name = spec.model or model_name
        self.version = runner.version if runner is not None else 0
        self.versions: dict[str, int] = {}
        self.runner = runner
        self.scheduler: BatchScheduler | None = None

    async def start(self) -> None:
        if self.scheduler is not None:
            return
        if self.runner is None:
            self.runner = await asyncio.to_thread(build_runner, self.spec)
        self.version = self.runner.version
        self.scheduler = BatchScheduler(
            self.runner, max_batch=self.spec.max_batch, window_ms=self.spec.batch_window_ms
        )
        await self.scheduler.start()

    async def complete(self, req: GenerateRequest) -> BackendResult:
        sched = self.scheduler
        if sched is None or self.runner is None:
            raise BackendError(ErrorKind.connect, f"{self.name}: local runner not started")
        ids = req.prompt_ids
        vocab = self.runner.tok.vocab_size
        if not ids:
            raise BackendError(ErrorKind.client, f"{self.name}: prompt is empty", status=400)
        if min(ids) < 0 or max(ids) >= vocab:
            raise BackendError(
                ErrorKind.client, f"{self.name}: prompt token ids must be in [0, {vocab})", status=400
            )
        if len(ids) >= self.runner.max_len:
            raise BackendError(
                ErrorKind.client,
                f"{self.name}: prompt of {len(ids)} tokens exceeds {self.runner.max_len}",
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
            out = await sched.submit(GenRequest(list(ids), params, job_id=req.job_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed batch is the backend's fault: retryable
            raise BackendError(ErrorKind.server, f"{self.name}: {type(exc).__name__}: {exc}") from exc
        if out.adapter is None:
            self.version = max(self.version, out.policy_version)
        return BackendResult(
            prompt_ids=out.prompt_ids,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            text=out.text,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            policy_version=out.policy_version,
            backend=self.name,
        )

    async def load_weights(self, *, version: int, path: Path | None = None, key: str | None = None) -> float:
        if self.scheduler is None:
            raise BackendError(ErrorKind.connect, f"{self.name}: local runner not started")
        if path is None:
            raise BackendError(
                ErrorKind.client, f"{self.name}: a local reload needs the fetched checkpoint file"
            )
        seconds = await self.scheduler.reload(path, version)
        assert self.runner is not None
        self.version = self.runner.version  # a LoRA version became its job's adapter, not the base
        return seconds

    async def served_version(self) -> int | None:
        return self.runner.version if self.runner is not None else None

    async def health(self) -> bool:
        task = self.scheduler._task if self.scheduler is not None else None
        return task is not None and not task.done()

    async def aclose(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()
            self.scheduler = None
