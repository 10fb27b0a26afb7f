"""An episode as a conversation, for the reward components that read the whole of it
(``reward_model``, ``judge``) rather than the submission.

The transcript is what a grader should see: the task (a ``user`` message with the task's
prompt), then per turn the model's reply as it wrote it (an ``assistant`` message) and
what the sandbox answered (a message in the environment's tool role, ``tool`` unless the
job set ``environment.tool_role: user``). The environment's system prompt (its
instructions to the policy) is left out. Built from the episode's steps while it is scored
(:func:`from_steps`), or from its stored trajectory when it is re-scored
(:func:`from_trajectory`); both give the same messages for the same episode.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from temper.trajectory import Trajectory

ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


class Transcript(BaseModel):
    """OpenAI chat messages (``role``, ``content``)."""

    model_config = ConfigDict(frozen=True)
    messages: list[dict[str, Any]]

    def digest(self) -> str:
        """SHA-256 of the messages (canonical JSON): the key graders cache a score by."""
        return hashlib.sha256(
            json.dumps(self.messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        ).hexdigest()

    def as_text(self) -> str:
        """Plain text, one block per message: ``User: ...``, ``Assistant: ...``, ``Tool: ...``."""
        return "\n\n".join(
            f"{ROLE_NAMES.get(m['role'], m['role'])}: {m.get('content') or ''}" for m in self.messages
        )

    def last_reply(self) -> str:
        """The model's last reply ('' when it made none)."""
        replies = [m for m in self.messages if m["role"] == "assistant"]
        return str(replies[-1].get("content") or "") if replies else ""


def build(prompt: str, turns: Iterable[tuple[str, str]], *, tool_role: str = "tool") -> Transcript:
    """The transcript of a task ``prompt`` and (reply, observation) turns; an empty
    observation adds no message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for reply, observation in turns:
        messages.append({"role": "assistant", "content": reply})
        if observation:
            messages.append({"role": tool_role, "content": observation})
    return Transcript(messages=messages)


def from_steps(prompt: str, steps: Iterable[Any], *, tool_role: str = "tool") -> Transcript:
    """From an episode's step rows (``temper.db.Step``: ``kind``, ``turn``, ``state``,
    ``result``): each done inference step's text, and its turn's sandbox observation."""
    inference: dict[int, dict[str, Any]] = {}
    observed: dict[int, str] = {}
    for step in steps:
        result = step.result or {}
        if step.kind == "inference" and step.state == "done":
            inference[step.turn] = result
        elif step.kind == "sandbox" and result.get("observation"):
            observed[step.turn] = str(result["observation"])
    turns = [
        (str(r.get("text") or ""), observed.get(turn) or str(r.get("observation") or ""))
        for turn, r in sorted(inference.items())
    ]
    return build(prompt, turns, tool_role=tool_role)


def from_trajectory(prompt: str, trajectory: Trajectory, *, tool_role: str = "tool") -> Transcript:
    """From a stored trajectory's turns (re-scoring)."""
    turns = [(t.action_text, t.observation) for t in sorted(trajectory.turns, key=lambda t: t.turn)]
    return build(prompt, turns, tool_role=tool_role)
