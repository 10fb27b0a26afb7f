"""What the trainer holds of one job in memory: its learner, the trajectories buffered by
group until a group is complete, the steps trained since the last published version and
the state of a publish that failed. The ledger in the database
(:mod:`services.trainer.ledger`) is the durable side of the same buffer."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from services.trainer.ledger import SKIP_INCOMPLETE, SKIP_STALE, SKIP_ZERO_VARIANCE
from temper.jobspec import JobSpec
from temper.training import Learner, is_zero_variance
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
    # zero-variance groups skipped since the last step: a policy that collapsed (every
    # answer fails alike) makes only those, and with the skip no step comes to change it
    flat_since_step: int = 0
    # A publish (checkpoint) that failed: retried by the loop with backoff until it succeeds.
    publish_error: str | None = None
    publish_failures: int = 0
    publish_failing_since: float = 0.0
    next_publish_at: float = 0.0
    mismatch_reason: str | None = None  # the canary's reason on the job, while it holds
    closed_checked_at: float = 0.0  # monotonic time the incomplete groups were last looked up
    # the data of a job without episodes (services.trainer.supervised.encode_tasks): sft, each
    # conversation's ids and trained mask; dpo and reward_model, pairs of those
    conversations: list[Any] | None = None
    sft_error: str | None = None  # why such a job cannot train (shown as its stuck reason)

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

    def sweep(
        self, now: float, group_timeout_s: float, closed: AbstractSet[str] = frozenset()
    ) -> list[tuple[list[Buffered], str]]:
        """Take out what cannot be trained on and return it with the reason: ready groups
        with zero reward variance (when the job skips them) or older than ``max_staleness``
        versions, and incomplete groups that are ``closed`` (nothing more will come) or
        still incomplete ``group_timeout_s`` after their first trajectory arrived, with fewer
        than 2 samples (those with 2 or more become ready as they are). Call it with
        ``lock`` held."""
        dropped: list[tuple[list[Buffered], str]] = []
        for gid, items in list(self.groups.items()):
            if gid in closed or now - min(b.arrived for b in items) >= group_timeout_s:
                del self.groups[gid]
                if len(items) >= 2:
                    self.ready.append(items)
                else:
                    dropped.append((items, SKIP_INCOMPLETE))
        keep = []
        for items in self.ready:
            if self.spec.algorithm.skip_zero_variance and is_zero_variance(
                [b.trajectory.reward for b in items]
            ):
                dropped.append((items, SKIP_ZERO_VARIANCE))
                self.flat_since_step += 1
            elif max(self.learner.version - b.trajectory.behaviour_version for b in items) > (
                self.spec.schedule.max_staleness
            ):
                dropped.append((items, SKIP_STALE))
            else:
                keep.append(items)
        self.ready = keep
        return dropped

    def status(self) -> dict[str, Any]:
        """This job's part of the trainer's ``GET /v1/status``."""
        shared = self.learner.shared
        return {
            "policy_version": self.learner.version,
            "shared_base": shared.key if shared is not None else None,
            "step": self.learner.step_count,
            "buffered_trajectories": self.buffered,
            "ready_groups": len(self.ready),
            "uncheckpointed_steps": self.steps_since_checkpoint,
            "publish_error": self.publish_error,
            "publish_failures": self.publish_failures,
            "skipped_groups": dict(self.skipped),
            "zero_variance_since_step": self.flat_since_step,
            "last_step": self.history[-1] if self.history else None,
        }
