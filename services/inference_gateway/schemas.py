"""HTTP request bodies of the gateway's own routes (the completion body and response are
the CPU model server's, ``cpu_server/schemas.py``: the gateway speaks the same subset of
vLLM's API)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from temper.settings.inference import ToolParser


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


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
    tool_choice: str | dict[str, Any] | None = None  # accepted; the model decides ("auto")
    tool_parser: ToolParser | None = Field(None, description="overrides the gateway's tool_parser setting")


class ReloadBody(BaseModel):
    job_id: str | None = None
    version: int
    checkpoint_key: str | None = None
    path: str | None = None
