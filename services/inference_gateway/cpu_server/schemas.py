"""Request and response bodies of the CPU model server's HTTP API (the subset of vLLM's
OpenAI-compatible API Temper uses); the gateway's proxy answers in the same shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.inference_gateway.cpu_server.runner import GenOutput

VERSION_HEADER = "X-Temper-Policy-Version"


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=1)
    echo: bool = False
    stream: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    job_id: str | None = Field(
        None,
        description="Temper's: the job whose weights run it (its adapter, its full weights, or the base)",
    )
    partial_rollout: bool = Field(
        False,
        description="Temper's: the job's next version interrupts this generation, which goes on from its "
        "prefix on that version (each choice's token_versions say which version sampled each token)",
    )


class LoadWeightsBody(BaseModel):
    version: int
    path: str | None = None
    key: str | None = None
    job_id: str | None = Field(
        None, description="whose full weights a file or model directory is (a registry version names its job)"
    )


class LoadBaseBody(BaseModel):
    name: str = Field(description="the model as jobs name it (policy.model or policy.init)")
    path: str | None = Field(None, description="a model directory here")
    key: str | None = Field(
        None, description="else the object-store prefix of one (neither: its own weights)"
    )


class ReleaseBody(BaseModel):
    job_id: str


def completion_response(
    outs: list[GenOutput], body: CompletionBody, *, model: str, token_str: Callable[[int], str]
) -> dict[str, Any]:
    """vLLM's ``CompletionResponse`` for our outputs (see docs/inference.md for the fields)."""
    choices = []
    for i, o in enumerate(outs):
        lp = None
        if body.logprobs is not None:
            tokens = (
                [f"token_id:{t}" for t in o.token_ids]
                if body.return_tokens_as_token_ids
                else [token_str(t) for t in o.token_ids]
            )
            offsets, at = [], 0
            for t in o.token_ids:
                offsets.append(at)
                at += len(token_str(t))
            lp = {
                "text_offset": offsets,
                "token_logprobs": o.logprobs,
                "tokens": tokens,
                "top_logprobs": [{tok: v} for tok, v in zip(tokens, o.logprobs, strict=True)]
                if body.logprobs > 0
                else None,
            }
        choices.append(
            {
                "index": i,
                "text": o.text,
                "logprobs": lp,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "token_ids": o.token_ids if body.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": o.prompt_ids if body.return_token_ids else None,
                "token_versions": o.token_versions,  # Temper's: the version of each token
            }
        )
    n_prompt = sum(len(o.prompt_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "policy_version": min(o.policy_version for o in outs) if outs else None,
    }
