"""The model backend interface (:class:`Backend`), what it answers, and the HTTP client that
two of its kinds share: both speak the OpenAI-compatible completions API.

- :class:`CpuServerBackend` (here): Temper's CPU model server. Reports ``policy_version``
  in every response; reloads with ``POST /v1/load_weights``.
- :class:`services.inference_gateway.vllm_backend.VLLMBackend`: a vLLM server.
- :class:`services.inference_gateway.local.LocalBackend`: the CPU model runner in-process.
"""

from __future__ import annotations

import re
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
from temper.settings.inference import BackendSpec


class ErrorKind(StrEnum):
    timeout = "timeout"
    connect = "connect"
    server = "server_error"  # 5xx, 429
    client = "client_error"  # other 4xx: the request is wrong, retrying will not help
    protocol = "protocol_error"  # a 2xx we cannot read
    not_served = "not_served"  # 409: the job's weights are not on this backend (now): try another


class BackendError(Exception):
    def __init__(self, kind: ErrorKind, detail: str, *, status: int | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.kind in (ErrorKind.timeout, ErrorKind.connect, ErrorKind.server, ErrorKind.not_served)


@dataclass
class GenerateRequest:
    """What the router asks a backend for: token ids in, token ids out."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    episode_id: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    job_id: str | None = None  # whose weights run it: its adapter, its full weights, or the base
    # What the gateway's table says the chosen backend serves for the job (set per attempt):
    # vLLM is sent the adapter and the result tagged with the version; the CPU backends
    # answer with the version their runner really used.
    version: int = 0
    adapter: str | None = None
    # the episode takes partial rollouts: a backend that can (the CPU runner) interrupts the
    # generation when the job's next version is loaded and resumes it there with its prefix
    partial_rollout: bool = False


@dataclass
class Served:
    """What a backend serves now, as it reports it (``Backend.served``); the gateway's
    table of served versions records it. ``base``: the model its base weights are (a model
    directory, an object key, a preset or a served name); ``at_origin``: the weights it
    started with; ``owner``: the job whose full weights replaced the base, at ``version``;
    ``adapters``: job -> the version of its LoRA adapter on the base."""

    base: str = ""
    at_origin: bool = True
    owner: str | None = None
    version: int = 0
    adapters: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Served:
        return cls(
            base=str(data.get("base") or ""),
            at_origin=bool(data.get("at_origin", True)),
            owner=data.get("owner"),
            version=int(data.get("version") or 0),
            adapters={str(k): int(v) for k, v in (data.get("adapters") or {}).items()},
        )


@dataclass
class BackendResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    policy_version: int  # the version that sampled the last token
    backend: str = ""
    # the version that sampled each token; empty: every token is ``policy_version``'s
    token_versions: list[int] = field(default_factory=list)

    def versions(self) -> list[int]:
        """The version of each token (``token_versions``, else ``policy_version`` for all)."""
        return (
            list(self.token_versions) if self.token_versions else [self.policy_version] * len(self.token_ids)
        )


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
    """One model server. What it serves is what it reports (:meth:`served`); the gateway
    keeps no version of its own in a backend. ``loads_models``: it can change its base
    model and load full weights of another architecture (the CPU model server), which a
    vLLM server cannot (its base is the model it was started with)."""

    loads_models = False

    def __init__(
        self, spec: BackendSpec, *, model_name: str, timeout_s: float = 60.0, connect_timeout_s: float = 2.0
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.url = spec.url.rstrip("/")
        self.model_name = spec.model or model_name
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
    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        """Load ``version`` of a job (a registry version names its job; a bare file or
        directory is ``job_id``'s full weights); returns the switch time in seconds."""

    @abstractmethod
    async def served(self) -> Served | None:
        """What this backend serves now, as it says itself; None when it cannot be asked."""

    @abstractmethod
    async def release(self, job_id: str) -> float:
        """A job ended: unload its adapters, and put the base back where its full weights were."""

    async def load_base(self, name: str, path: Path | None) -> float:
        """Serve the model directory ``path`` as the base, named ``name`` (``loads_models``
        only); ``path`` None: the weights the backend started with."""
        raise BackendError(ErrorKind.client, f"{self.name}: this backend cannot change its base model")

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
        if r.status_code == 409:
            raise BackendError(ErrorKind.not_served, f"{self.name}{path}: {r.text[:200]}", status=409)
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
        if status == 409:
            raise BackendError(
                ErrorKind.not_served,
                f"{self.name}{path}: {content[:200].decode(errors='replace')}",
                status=409,
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
    """Temper's CPU model server (``python -m services.inference_gateway.cpu_server``): it
    answers every completion with the version its runner used, reports what it holds on
    ``GET /health`` and answers 409 for a job whose weights it does not hold now."""

    loads_models = True

    async def complete(self, req: GenerateRequest) -> BackendResult:
        body = self.completion_body(req, model=self.model_name)
        if req.job_id:
            body["job_id"] = req.job_id  # the server runs the job's own weights
        if req.partial_rollout:
            body["partial_rollout"] = True
        data = await self.post("/v1/completions", body)
        fields = parse_completion(data, req.prompt_ids)
        version = data.get("policy_version")
        if version is None:
            raise BackendError(ErrorKind.protocol, f"{self.name}: the answer names no policy_version")
        versions = [int(v) for v in (data.get("choices") or [{}])[0].get("token_versions") or []]
        if versions and len(versions) != len(fields["token_ids"]):
            raise BackendError(
                ErrorKind.protocol, f"{len(fields['token_ids'])} token ids but {len(versions)} token versions"
            )
        return BackendResult(
            **fields, policy_version=int(version), backend=self.name, token_versions=versions
        )

    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        body: dict[str, Any] = {"version": version, "job_id": job_id}
        if path is not None:
            body["path"] = str(path)
        if key is not None:
            body["key"] = key
        data = await self.post("/v1/load_weights", body, wait_s=300.0)
        return float(data["switch_ms"]) / 1000

    async def load_base(self, name: str, path: Path | None) -> float:
        body = {"name": name, "path": str(path) if path is not None else None}
        data = await self.post("/v1/load_base", body, wait_s=300.0)
        return float(data["switch_ms"]) / 1000

    async def release(self, job_id: str) -> float:
        data = await self.post("/v1/release", {"job_id": job_id}, wait_s=300.0)
        return float(data["switch_ms"]) / 1000

    async def served(self) -> Served | None:
        try:
            r = await self.client.get("/health", timeout=2.0)
            return Served.from_dict(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None


ADAPTER_NAME = re.compile(r"^(?P<job>.+)-v(?P<version>\d+)$")


def adapter_name(job_id: str, version: int) -> str:
    """The LoRA adapter name of a job's version on vLLM (and the CPU engine)."""
    return f"{job_id}-v{version}"


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """``<job>-v<version>`` (see :func:`adapter_name`) back to its job and version."""
    m = ADAPTER_NAME.match(name)
    return (m["job"], int(m["version"])) if m else None


def registry_manifest(path: Path) -> Manifest | None:
    """The registry manifest of a fetched version directory (checked), or None for a bare file."""
    if not (Path(path) / MANIFEST_FILE).is_file():
        return None
    try:
        return verify_directory(path)
    except CorruptVersion as exc:
        raise BackendError(ErrorKind.client, str(exc)) from exc
