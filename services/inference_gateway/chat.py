"""Chat completions in OpenAI's shapes, for the proxy's chat routes (``routes.py``): the
checks of a request's fields, the tool calls read from a reply, and the answer whole or
streamed as server-sent events (``stream: true``). The gateway samples a reply whole, then
streams it: the chunks carry what a streaming client reads (the role, the content, each
tool call, the finish reason, the usage when ``stream_options.include_usage`` asks)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.inference_gateway.backends import BackendResult
from services.inference_gateway.schemas import ChatBody
from services.inference_gateway.tool_calls import parse_tool_calls
from temper.policy import ChatTokenizer


class BadRequest(ValueError):
    """A request field the gateway does not implement, or a value it cannot honour (400)."""


def refused_fields(body: ChatBody) -> str | None:
    """Why the gateway cannot answer ``body`` as asked, or None: it samples one choice with
    the model's own distribution (no penalties, biases or constrained decoding), and reads
    tool calls from what the model wrote (so it cannot force one)."""
    if body.n != 1:
        return f"n={body.n}: the gateway samples one choice per request"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            return f"{name}: not supported (it would change the distribution the trainer learns from)"
    if body.logit_bias:
        return "logit_bias: not supported (it would change the distribution the trainer learns from)"
    if body.top_logprobs:
        return "top_logprobs: not supported; logprobs: true gives each sampled token's logprob"
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        return f"response_format {fmt!r}: not supported (no constrained decoding); only text"
    choice = body.tool_choice
    if isinstance(choice, dict) or choice not in (None, "auto", "none"):
        return (
            f"tool_choice {choice!r}: the gateway cannot force a call (no constrained decoding); "
            "use auto or none"
        )
    return None


def read_tool_calls(
    tok: ChatTokenizer,
    result: BackendResult,
    parser: str,
    *,
    parallel: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a sampled reply (``tool_calls.parse_tool_calls``), read
    from its text with its special tokens (Mistral's ``[TOOL_CALLS]`` is one); a reply with
    no call is its plain text."""
    text = tok.parse_text(result.token_ids, result.text)
    calls = parse_tool_calls(text, parser, parallel=parallel, tools=tools)
    return calls if calls[1] else (result.text, [])


@dataclass
class ChatAnswer:
    """One answered chat call: the sampled result and the assistant message made of it."""

    request_id: str
    model: str
    result: BackendResult
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else (self.result.finish_reason or "stop")

    def message(self) -> dict[str, Any]:
        """The assistant message as a client sends it back in its next call's history."""
        return {"role": "assistant", "content": self.content, "tool_calls": self.tool_calls}

    def usage(self) -> dict[str, Any]:
        n_prompt, n_out = len(self.result.prompt_ids), len(self.result.token_ids)
        return {
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": None,
        }

    def content_logprobs(self, tok: ChatTokenizer) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token": f"token_id:{t}",
                    "logprob": lp,
                    "bytes": list(tok.token_str(t).encode()),
                    "top_logprobs": [],
                }
                for t, lp in zip(self.result.token_ids, self.result.logprobs, strict=True)
            ]
        }


def completion(answer: ChatAnswer, tok: ChatTokenizer, *, logprobs: bool) -> dict[str, Any]:
    """The whole answer, as vLLM's ``chat.completion`` with token ids and the version."""
    res = answer.result
    return {
        "id": answer.request_id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": answer.content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": answer.tool_calls,
                    "reasoning_content": None,
                },
                "logprobs": answer.content_logprobs(tok) if logprobs else None,
                "finish_reason": answer.finish_reason,
                "stop_reason": res.stop_reason,
                "token_ids": res.token_ids,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": answer.usage(),
        "prompt_logprobs": None,
        "prompt_token_ids": res.prompt_ids,
        "kv_transfer_params": None,
        "policy_version": res.policy_version,
    }


def stream(answer: ChatAnswer, tok: ChatTokenizer, *, logprobs: bool, include_usage: bool) -> Iterator[bytes]:
    """The answer as ``chat.completion.chunk`` server-sent events, then ``data: [DONE]``:
    the role, the content (with its logprobs when asked), one chunk per tool call, the
    finish reason (with the sampled token ids and the prompt's), and the usage when
    ``include_usage``."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {
            "id": answer.request_id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "choices": choices,
            "policy_version": answer.result.policy_version,
            **extra,
        }
        return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def choice(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}

    yield chunk([choice({"role": "assistant", "content": ""})])
    if answer.content:
        lp = answer.content_logprobs(tok) if logprobs else None
        yield chunk([choice({"content": answer.content}, logprobs=lp)])
    for i, call in enumerate(answer.tool_calls):
        yield chunk([choice({"tool_calls": [{"index": i, **call}]})])
    res = answer.result
    yield chunk(
        [
            choice(
                {}, finish_reason=answer.finish_reason, stop_reason=res.stop_reason, token_ids=res.token_ids
            )
        ],
        prompt_token_ids=res.prompt_ids,
    )
    if include_usage:
        yield chunk([], usage=answer.usage())
    yield b"data: [DONE]\n\n"
