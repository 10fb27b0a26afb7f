"""Per-episode chat state of the OpenAI-compatible proxy: each turn extends the previous
turn's token ids instead of encoding the conversation afresh."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from temper.policy import ChatTokenizer, encode_chat, extend_chat


class ChatSessions:
    """Per-episode conversation state, so each turn extends the previous ids token-wise.

    A session remembers the messages it has seen (including the assistant replies it
    produced) and the exact ids behind them. When the next call's messages start with
    those, only the new messages are encoded and appended; otherwise the conversation is
    encoded afresh (and the session restarts).
    """

    def __init__(self, tokenizer: ChatTokenizer, max_sessions: int = 10_000) -> None:
        self.tok = tokenizer
        self.max_sessions = max_sessions
        self._s: OrderedDict[str, tuple[list[dict[str, Any]], list[int]]] = OrderedDict()
        self.extended = 0
        self.encoded = 0

    @staticmethod
    def _norm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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

    def prompt_ids(
        self,
        episode_id: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        msgs = self._norm(messages)
        if episode_id and episode_id in self._s:
            seen, ids = self._s[episode_id]
            if len(msgs) > len(seen) and msgs[: len(seen)] == seen:
                self.extended += 1
                return extend_chat(self.tok, ids, msgs[len(seen) :], tools=tools)
        self.encoded += 1
        return encode_chat(self.tok, msgs, tools=tools)

    def remember(
        self,
        episode_id: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        reply_text: str,
        reply_ids: list[int],
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        reply: dict[str, Any] = {"role": "assistant", "content": reply_text}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        seen = [*self._norm(messages), *self._norm([reply])]
        self._s[episode_id] = (seen, [*prompt_ids, *reply_ids])
        self._s.move_to_end(episode_id)
        while len(self._s) > self.max_sessions:
            self._s.popitem(last=False)
