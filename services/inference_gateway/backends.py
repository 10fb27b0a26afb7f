"""Model backends behind one interface. Two speak vLLM's OpenAI-compatible HTTP API; the
third (:class:`services.inference_gateway.local.LocalBackend`) runs the CPU engine in-process.

- :class:`CpuServerBackend`: Temper's CPU engine. Reports ``policy_version`` in every
  response; reloads with ``POST /v1/load_weights``.
- :class:`VLLMBackend`: a vLLM server. Targets vLLM >= 0.10.2 (``return_token_ids``:
  ``choices[].token_ids``); for 0.6.x-0.10.1 token ids are read from
  ``logprobs.tokens`` (``"token_id:<id>"``, via ``return_tokens_as_token_ids``). Reload:
  a LoRA adapter per policy version (``/v1/load_lora_adapter``, needs
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), or a full reload through
  ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``). See docs/inference.md.
"""

from __future__ import annotations

import asyncio
import os
import shutil
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
    """A vLLM OpenAI-compatible server (pinned: vLLM 0.33.0, see docs/inference.md).

    With ``reload_mode=lora`` each policy version is a LoRA adapter named
    ``<job>-v<version>``, loaded through vLLM's runtime LoRA API from a path the vLLM
    server reads (the gateway's checkpoint cache on a volume both mount). A request names
    its job's adapter, and its result carries that adapter's version: a version is used
    only after ``/v1/load_lora_adapter`` answered 200 for it. The job's adapter two
    versions back is unloaded. Requests of a job with no adapter yet run on the base model
    (version 0).

    With ``reload_mode=full`` the new weights are first written into the directory vLLM
    serves (``model_dir`` of the backend spec, on the shared volume), then the server
    reloads them in place through ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``).
    """

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

    def route(self, job_id: str | None) -> tuple[str, int]:
        """The model name a request of ``job_id`` is sent with, and the version that is."""
        loaded = self.adapters.get(job_id or "")
        if self.reload_mode is VLLMReloadMode.lora and loaded:
            return loaded[-1]
        return self.served_model, self.version

    async def complete(self, req: GenerateRequest) -> BackendResult:
        model, version = self.route(req.job_id)
        data = await self.post("/v1/completions", self.completion_body(req, model=model))
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
            name = adapter_name(manifest.job_id, version)
            await self.post(
                "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, raw=True, wait_s=300.0
            )
            loaded = self.adapters.setdefault(manifest.job_id, [])
            loaded.append((name, version))
            while len(loaded) > 2:
                old, _ = loaded.pop(0)
                try:
                    await self.post("/v1/unload_lora_adapter", {"lora_name": old}, raw=True)
                except BackendError:
                    pass  # a leftover adapter costs memory, not correctness
            # self.version stays the base model's: requests without an adapter still run on it
        else:
            if manifest is not None and manifest.kind != "full":
                raise BackendError(
                    ErrorKind.client, f"{self.name}: reload_mode=full cannot load a LoRA version"
                )
            if not self.spec.model_dir:
                raise BackendError(
                    ErrorKind.client,
                    f"{self.name}: reload_mode=full needs model_dir: the directory vLLM serves, on a volume "
                    "the gateway writes",
                )
            await asyncio.to_thread(write_full_weights, path, Path(self.spec.model_dir))
            await self.post("/collective_rpc", {"method": "reload_weights"}, raw=True, wait_s=600.0)
            self.version = version
        return time.perf_counter() - t0


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


def write_full_weights(src: Path, dest: Path) -> None:
    """Put a full version's weights into the directory vLLM reloads from: every shard
    first under a temporary name, then renamed, the index last."""
    src = Path(src)
    names = [p.name for p in src.iterdir() if p.suffix == ".safetensors"] if src.is_dir() else []
    if not names:
        raise BackendError(ErrorKind.client, f"{src}: no safetensors weights to write for vLLM")
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(names):
        tmp = dest / f".{name}.tmp"
        shutil.copyfile(src / name, tmp)
        os.replace(tmp, dest / name)
    for extra in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        if (src / extra).is_file():
            shutil.copyfile(src / extra, dest / f".{extra}.tmp")
            os.replace(dest / f".{extra}.tmp", dest / extra)


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
