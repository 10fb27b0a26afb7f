"""Conversations as training data: the OpenAI chat format, with tools.

A chat task (``kind: chat``) is one conversation: ``messages`` (``system``, ``user``,
``assistant``, ``tool``) and optional ``tools`` (OpenAI function schemas, given to the
chat template). Which assistant turns the loss covers is marked per message: Temper's
``train: true|false`` (as the warm start's replies) or OpenAI's fine-tuning ``weight:
0|1``; an assistant message without either is trained. Everything is checked when the
task set is uploaded, with the message's index in the error.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class ChatFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME.pattern)
    # OpenAI sends a JSON string; templates render an object: stored as the object
    arguments: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _parse_arguments(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("arguments"), str):
            try:
                parsed = json.loads(data["arguments"])
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments is not valid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(parsed, dict):
                raise ValueError("arguments must be a JSON object")
            data = {**data, "arguments": parsed}
        return data


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=200)
    type: Literal["function"] = "function"
    function: ChatFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = Field(None, max_length=200)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=200)
    train: bool | None = Field(None, description="assistant only: whether the loss covers this turn")
    weight: Literal[0, 1] | None = Field(None, description="OpenAI's form of train: 1 trained, 0 not")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role != "assistant":
            for field in ("train", "weight", "tool_calls"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field} applies to assistant messages only (this one is {self.role})")
            if self.content is None:
                raise ValueError(f"a {self.role} message needs a string content")
        elif self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id applies to tool messages only")
        if self.train is not None and self.weight is not None and self.train != bool(self.weight):
            raise ValueError(f"train: {str(self.train).lower()} and weight: {self.weight} disagree")
        return self

    @property
    def trained(self) -> bool:
        if self.role != "assistant":
            return False
        if self.train is not None:
            return self.train
        return self.weight != 0

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template reads it (no training marks)."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"train", "weight"})


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @model_validator(mode="after")
    def _function(self) -> ChatTool:
        name = self.function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError("function.name must be a tool name (letters, digits, _ . -; at most 64)")
        params = self.function.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError("function.parameters must be a JSON schema of type object")
        return self


def check_conversation(messages: list[ChatMessage]) -> None:
    """The order rules: something before the first assistant turn, a tool message only
    after an assistant or tool message, the conversation ends with an assistant turn, and
    at least one turn is trained."""
    if not messages:
        raise ValueError("messages: a conversation needs at least one message")
    if messages[0].role == "assistant":
        raise ValueError("messages.0: a conversation starts with a system or user message")
    for i, m in enumerate(messages):
        if m.role == "tool" and messages[i - 1].role not in ("assistant", "tool"):
            raise ValueError(f"messages.{i}: a tool message follows an assistant (or tool) message")
    if messages[-1].role != "assistant":
        raise ValueError(
            f"messages.{len(messages) - 1}: the conversation ends with a {messages[-1].role} message; "
            "nothing after the last assistant turn is trained (end with an assistant message)"
        )
    if not any(m.trained for m in messages):
        raise ValueError("messages: no assistant turn is trained (every one has train: false or weight: 0)")


def prompt_of(messages: list[ChatMessage]) -> str:
    """What a listing shows for a conversation: its first user message (else its first)."""
    first = next((m for m in messages if m.role == "user"), messages[0])
    return (first.content or "(no content)")[:2000]
