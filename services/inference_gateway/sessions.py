"""Per-episode chat state of the OpenAI-compatible proxy: each turn extends the previous
turn's token ids instead of encoding the conversation afresh."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from temper.policy import ChatTokenizer, encode_chat, extend_chat


@dataclass
class _Session:
    seen: list[dict[str, Any]]  # the messages the ids stand for, normalised
    ids: list[int]  # the last prompt and the ids sampled after it
    tools: list[dict[str, Any]] | None


class ChatSessions:
    """Per-episode conversation state, so each turn extends the previous ids token-wise.

    A session remembers the messages it has seen (including the assistant reply it
    answered, as the client sends it back: its content and its ``tool_calls``), the tools
    they were rendered with, and the exact ids behind them. When the next call's messages
    start with those and its tools are the same, only the new messages are encoded and
    appended to the ids; otherwise the conversation is encoded afresh (and the session
    restarts). The ids the model sampled are never re-tokenised on the extending path.
    """

    def __init__(self, tokenizer: ChatTokenizer, max_sessions: int = 10_000) -> None:
        self.tok = tokenizer
        self.max_sessions = max_sessions
        self._s: OrderedDict[str, _Session] = OrderedDict()
        self.extended = 0
        self.encoded = 0

    @staticmethod
    def normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Role, content, (assistant) tool calls with their ids and their arguments as
        objects, the form chat templates render (OpenAI clients send arguments as JSON
        strings), and a tool message's ``tool_call_id`` and ``name`` (Mistral's templates
        refuse a tool message without the id)."""
        out: list[dict[str, Any]] = []
        for m in messages:
            msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = m[key]
            calls = []
            for c in m.get("tool_calls") or []:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise ValueError(
                            f"tool call arguments are not JSON: {fn['arguments'][:80]!r}"
                        ) from None
                call: dict[str, Any] = {"type": "function", "function": fn}
                if c.get("id") is not None:
                    call = {"id": c["id"], **call}
                calls.append(call)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        return out

    def has(self, key: str) -> bool:
        return key in self._s

    def prompt(
        self, key: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], bool]:
        """The prompt ids of ``messages`` and whether they extend the session ``key``'s ids
        token for token (else the conversation was encoded afresh)."""
        msgs = self.normalise(messages)
        session = self._s.get(key) if key else None
        if session is not None and session.tools == (tools or None):
            seen = session.seen
            if len(msgs) > len(seen) and msgs[: len(seen)] == seen:
                self.extended += 1
                return extend_chat(self.tok, session.ids, msgs[len(seen) :], tools=tools), True
        self.encoded += 1
        return encode_chat(self.tok, msgs, tools=tools), False

    def prompt_ids(
        self,
        episode_id: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.prompt(episode_id, messages, tools)[0]

    def remember(
        self,
        key: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        reply: dict[str, Any],
        reply_ids: list[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """After a call: ``messages`` and the assistant ``reply`` answered to them (as the
        client will send it back) stand for ``prompt_ids`` and the sampled ``reply_ids``."""
        seen = [*self.normalise(messages), *self.normalise([reply])]
        self._s[key] = _Session(seen, [*prompt_ids, *reply_ids], tools or None)
        self._s.move_to_end(key)
        while len(self._s) > self.max_sessions:
            self._s.popitem(last=False)
