"""What the trainer holds of one job in memory: its learner, the trajectories buffered by
group until a group is complete, the steps trained since the last published version and
the state of a publish that failed. The ledger in the database
(:mod:`services.trainer.ledger`) is the durable side of the same buffer."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from temper.jobspec import JobSpec
from temper.training import Learner
from temper.trajectory import Trajectory


@dataclass
class Buffered:
    trajectory: Trajectory
    key: str
    arrived: float  # unix time the ledger row was written

    @property
    def episode_id(self) -> str:
        return self.trajectory.episode_id


@dataclass
class TrainingJob:
    """One job's learner, buffer and not-yet-checkpointed steps."""

    job_id: str
    tenant_id: str
    spec: JobSpec
    learner: Learner
    groups: dict[str, list[Buffered]] = field(default_factory=dict)  # insertion order = arrival order
    ready: list[list[Buffered]] = field(default_factory=list)
    uncheckpointed: dict[str, int] = field(default_factory=dict)  # episode id -> step
    steps_since_checkpoint: int = 0
    seconds_since_checkpoint: float = 0.0  # trainer time of those steps: the version's train_s
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the buffer
    train_lock: asyncio.Lock = field(
        default_factory=asyncio.Lock
    )  # the learner: one step or checkpoint at a time
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=1000))
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> groups
    # A publish (checkpoint) that failed: retried by the loop with backoff until it succeeds.
    publish_error: str | None = None
    publish_failures: int = 0
    publish_failing_since: float = 0.0
    next_publish_at: float = 0.0

    def holds(self, episode_id: str) -> bool:
        return any(b.episode_id == episode_id for g in (*self.groups.values(), *self.ready) for b in g)

    @property
    def buffered(self) -> int:
        return sum(len(g) for g in self.groups.values()) + sum(len(g) for g in self.ready)

    def add(self, item: Buffered) -> None:
        """Buffer one trajectory; its group moves to ``ready`` once it has ``group_size``."""
        group = self.groups.setdefault(item.trajectory.group_id, [])
        group.append(item)
        if len(group) >= self.spec.tasks.group_size:
            self.ready.append(self.groups.pop(item.trajectory.group_id))

    def episodes(self) -> list[str]:
        """Every episode this job buffers, complete groups or not."""
        return [b.episode_id for g in (*self.groups.values(), *self.ready) for b in g]
