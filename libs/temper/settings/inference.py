"""Settings of the inference gateway (``TEMPER_INFERENCE__*``).

Backends are a bare URL, a comma-separated list of URLs (CPU server backends named
``b0``, ``b1``, ...; ``vllm+http://...`` for a vLLM server), or JSON, e.g.
``TEMPER_INFERENCE__BACKENDS='[{"name":"e0","url":"http://127.0.0.1:8010"},{"name":"v0","url":"http://gpu1:8000","kind":"vllm"}]'``,
or ``'[{"name":"local-0","kind":"local"}]'`` for the CPU engine inside the gateway process.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode


class BackendKind(StrEnum):
    cpu_server = "cpu_server"  # Temper's CPU model server over HTTP (services.inference_gateway.cpu_server)
    vllm = "vllm"  # a vLLM OpenAI-compatible server
    local = "local"  # the CPU engine inside the gateway process (no HTTP): embedded mode, tests


class VLLMReloadMode(StrEnum):
    lora = "lora"  # POST /v1/load_lora_adapter with a new adapter name per version
    full = (
        "full"  # POST /collective_rpc {"method": "reload_weights"} (dev mode) after the weights were written
    )


class ToolParser(StrEnum):
    hermes = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, Hermes)
    llama3_json = "llama3_json"  # {"name": ..., "parameters": ...} (Llama 3)
    mistral = "mistral"  # [TOOL_CALLS] [{"name": ..., "arguments": ...}] (Mistral)
    pythonic = "pythonic"  # [f(a=1), g()] (Llama 3.2, Gemma 3 as vLLM serves it)
    tool_code = "tool_code"  # ```tool_code\nf(a=1)\n``` (Gemma)
    qwen3_coder = "qwen3_coder"  # <tool_call><function=f><parameter=a>1</parameter></function></tool_call>


class BackendSpec(BaseModel):
    name: str
    url: str = Field("", description="base URL of a CPU model server or vLLM server; unused by kind=local")
    kind: BackendKind = BackendKind.cpu_server
    model: str | None = Field(None, description="model name to send; default: the gateway's model_name")
    max_inflight: int | None = Field(None, ge=1, description="overrides max_inflight_per_backend")
    pool: str = Field(
        "default", description="the backend pool it serves: jobs name theirs in policy.backend_pool"
    )
    # kind=local only: which model the in-process engine runs
    model_dir: str | None = Field(
        None, description="local: a model directory (config + safetensors + tokenizer)"
    )
    preset: str = Field("tiny", description="local: model preset with random weights when model_dir is unset")
    seed: int = Field(0, description="local: weight seed for preset")
    max_batch: int = Field(16, ge=1, description="local: largest batch")
    batch_window_ms: float = Field(3.0, ge=0, description="local: how long a batch waits for more requests")

    @field_validator("kind", mode="before")
    @classmethod
    def _renamed_kind(cls, value: object) -> object:
        if value == "engine":
            raise ValueError(
                "backend kind 'engine' was renamed 'cpu_server' (the CPU model server); use that"
            )
        return value

    @model_validator(mode="after")
    def _url_unless_local(self) -> BackendSpec:
        if self.kind is not BackendKind.local and not self.url:
            raise ValueError(f"backend {self.name!r} of kind {self.kind.value} needs a url")
        return self


class InferenceSettings(BaseModel):
    model_name: str = "temper-policy"
    requests_group: str = Field(
        "inference-gateway", description="consumer group of inference.requests, shared by replicas"
    )
    policy_group: str | None = Field(
        None,
        description="consumer group of policy.updates; unset: a fresh group per replica (inference-gateway-<uuid>)",
    )
    backends: Annotated[list[BackendSpec], NoDecode] = Field(
        default_factory=list,
        description="empty: one local backend in embedded mode; none (and /health 503) in distributed mode",
    )
    request_timeout_s: float = Field(60.0, gt=0)

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_from_text(cls, value: Any) -> Any:
        """JSON, or URLs separated by commas."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if not text:
            return []
        if text[0] in "[{":
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
            return [parsed] if isinstance(parsed, dict) else parsed
        specs = []
        for i, url in enumerate(u.strip() for u in text.split(",")):
            kind = BackendKind.cpu_server
            if url.startswith("vllm+"):
                kind, url = BackendKind.vllm, url.removeprefix("vllm+")
            if not url.startswith(("http://", "https://")) or len(url) <= len("http://"):
                raise ValueError(f"{url!r} is not an http(s) URL; give URLs separated by commas, or JSON")
            specs.append({"name": f"b{i}", "url": url.rstrip("/"), "kind": kind})
        return specs

    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(
        2, ge=0, description="attempts after the first, each on another backend if one is up"
    )
    retry_backoff_s: float = Field(0.05, ge=0, description="first backoff; doubles per retry, with jitter")
    max_inflight_per_backend: int = Field(32, ge=1)
    load_factor: float = Field(
        1.25, ge=1.0, description="bounded-load consistent hashing: cap = factor x mean load"
    )
    virtual_nodes: int = Field(64, ge=1)
    health_interval_s: float = Field(2.0, gt=0)
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that open a backend's circuit")
    breaker_reset_s: float = Field(5.0, gt=0, description="open time before one trial request is let through")
    vllm_reload_mode: VLLMReloadMode = VLLMReloadMode.lora
    tool_parser: ToolParser = Field(
        ToolParser.hermes,
        description="how the chat proxy reads tool calls from a reply (a request may override)",
    )
    checkpoint_cache_dir: str = ".temper/checkpoints"
