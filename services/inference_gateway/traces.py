"""Token-level traces of the calls an external agent makes through the OpenAI-compatible proxy.

Each call attributed to an episode (``X-Temper-Episode``) is recorded with the exact
prompt ids, sampled ids, their logprobs and the policy version, which is what the
trainer needs. The interface is async so a persistent store can replace the in-memory one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TraceEntry:
    episode_id: str
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    backend: str
    finish_reason: str | None
    endpoint: str  # "completions" | "chat.completions"
    created_at: float = field(default_factory=time.time)
    messages: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TraceStore(ABC):
    @abstractmethod
    async def record(self, entry: TraceEntry) -> None: ...

    @abstractmethod
    async def get(self, episode_id: str) -> list[TraceEntry]:
        """The episode's calls in the order they were recorded (empty if none)."""


class InMemoryTraceStore(TraceStore):
    """Keeps the traces of the ``max_episodes`` most recently active episodes."""

    def __init__(self, max_episodes: int = 10_000) -> None:
        self.max_episodes = max_episodes
        self._by_episode: OrderedDict[str, list[TraceEntry]] = OrderedDict()

    async def record(self, entry: TraceEntry) -> None:
        self._by_episode.setdefault(entry.episode_id, []).append(entry)
        self._by_episode.move_to_end(entry.episode_id)
        while len(self._by_episode) > self.max_episodes:
            self._by_episode.popitem(last=False)

    async def get(self, episode_id: str) -> list[TraceEntry]:
        return list(self._by_episode.get(episode_id, []))
