"""Settings of the inference gateway (``TEMPER_INFERENCE__*``).

Backends are given as JSON, e.g.
``TEMPER_INFERENCE__BACKENDS='[{"name":"e0","url":"http://127.0.0.1:8010"},{"name":"v0","url":"http://gpu1:8000","kind":"vllm"}]'``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class BackendKind(StrEnum):
    engine = "engine"  # Temper's CPU engine (services.inference_gateway.engine)
    vllm = "vllm"  # a vLLM OpenAI-compatible server


class VLLMReloadMode(StrEnum):
    lora = "lora"  # POST /v1/load_lora_adapter with a new adapter name per version
    full = "full"  # POST /collective_rpc {"method": "reload_weights"} (dev mode) after the weights were written


class BackendSpec(BaseModel):
    name: str
    url: str
    kind: BackendKind = BackendKind.engine
    model: str | None = Field(None, description="model name to send; default: the gateway's model_name")
    max_inflight: int | None = Field(None, ge=1, description="overrides max_inflight_per_backend")


class InferenceSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8001
    model_name: str = "temper-policy"
    backends: list[BackendSpec] = Field(
        default_factory=lambda: [BackendSpec(name="engine-0", url="http://127.0.0.1:8010")]
    )
    request_timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0, description="attempts after the first, each on another backend if one is up")
    retry_backoff_s: float = Field(0.05, ge=0, description="first backoff; doubles per retry, with jitter")
    max_inflight_per_backend: int = Field(32, ge=1)
    load_factor: float = Field(1.25, ge=1.0, description="bounded-load consistent hashing: cap = factor x mean load")
    virtual_nodes: int = Field(64, ge=1)
    health_interval_s: float = Field(2.0, gt=0)
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that open a backend's circuit")
    breaker_reset_s: float = Field(5.0, gt=0, description="open time before one trial request is let through")
    vllm_reload_mode: VLLMReloadMode = VLLMReloadMode.lora
    checkpoint_cache_dir: str = ".temper/checkpoints"
