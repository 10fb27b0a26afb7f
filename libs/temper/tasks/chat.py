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


def _same(a: ChatMessage, b: ChatMessage) -> bool:
    return a.template_message() == b.template_message()


def check_preference(
    messages: list[ChatMessage] | None, chosen: list[ChatMessage] | None, rejected: list[ChatMessage] | None
) -> tuple[list[ChatMessage], list[ChatMessage], list[ChatMessage]]:
    """A preference pair as (prompt, chosen, rejected): ``messages`` is the prompt, and
    ``chosen``/``rejected`` its two continuations, each starting with an assistant turn and
    ending with one (TRL's explicit-prompt form). Without ``messages`` the two are whole
    conversations and the prompt is the messages they share from the start (the implicit
    form); they are stored split."""
    if chosen is None or rejected is None:
        raise ValueError("a preference task needs chosen and rejected")
    if messages is None:
        n = 0
        while n < min(len(chosen), len(rejected)) and _same(chosen[n], rejected[n]):
            n += 1
        if n == 0:
            raise ValueError(
                "chosen and rejected share no first message: give the prompt as messages, or start both with it"
            )
        if n in (len(chosen), len(rejected)):
            raise ValueError("chosen and rejected are the same conversation, or one only extends the other")
        if chosen[n].role != "assistant" or rejected[n].role != "assistant":
            raise ValueError(
                f"chosen and rejected first differ at message {n}, which is not an assistant turn in both; "
                "they must first differ in what the assistant says"
            )
        messages, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not messages:
        raise ValueError("messages: a preference pair needs a prompt (at least one message)")
    if messages[-1].role == "assistant":
        raise ValueError(
            f"messages.{len(messages) - 1}: the prompt ends before an assistant turn (this one is assistant)"
        )
    marked = [i for i, m in enumerate(messages) if m.train is not None or m.weight is not None]
    if marked:
        raise ValueError(
            f"messages.{marked[0]}: the prompt is not trained; train and weight apply to chosen and rejected"
        )
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if not side:
            raise ValueError(
                f"{name}: empty (the two continuations must differ, each with an assistant turn)"
            )
        if side[0].role != "assistant":
            raise ValueError(
                f"{name}.0: a continuation starts with an assistant turn (this one is {side[0].role})"
            )
        try:
            check_conversation([*messages, *side])
        except ValueError as exc:
            raise ValueError(f"{name} (after the {len(messages)} prompt messages): {exc}") from None
    if len(chosen) == len(rejected) and all(_same(a, b) for a, b in zip(chosen, rejected, strict=True)):
        raise ValueError("chosen and rejected are the same continuation")
    return messages, chosen, rejected
