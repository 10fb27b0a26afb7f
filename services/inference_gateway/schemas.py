"""HTTP request bodies of the gateway's own routes (the completion body and response are
the CPU model server's, ``cpu_server/schemas.py``: the gateway speaks the same subset of
vLLM's API)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from temper.settings.inference import ToolParser


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """OpenAI's content parts (``[{"type": "text", "text": ...}]``) as their text; a
        part of another type (an image) is refused by name."""
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {kind!r}: the gateway takes text parts only")
            texts.append(part["text"])
        return "".join(texts)


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(
        None, description="OpenAI function schemas, passed to the chat template"
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="auto or none (the model decides; no call can be forced)"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: only the reply's first call")
    tool_parser: ToolParser | None = Field(None, description="overrides the gateway's tool_parser setting")
    stream_options: dict[str, Any] | None = Field(None, description="include_usage: a last chunk with usage")
    n: int = Field(1, ge=1, description="1 only")
    presence_penalty: float | None = Field(None, description="0 or unset only")
    frequency_penalty: float | None = Field(None, description="0 or unset only")
    logit_bias: dict[str, float] | None = Field(None, description="empty or unset only")
    top_logprobs: int | None = Field(None, ge=0, description="0 or unset only")
    response_format: dict[str, Any] | None = Field(None, description="text only")


class ReloadBody(BaseModel):
    job_id: str | None = None
    version: int
    checkpoint_key: str | None = None
    path: str | None = None
