"""Dynamic sampling (DAPO): a fresh group for each group the trainer skipped for zero
reward variance, so that optimizer batches keep ``groups_per_step`` groups with signal.

The hand-off is the trainer's ledger: the trainer marks a zero-variance group's rows
``skipped = 'zero_reward_variance'`` (durably, before it moves on), and the scheduler
reads two counts in the transaction that holds the job's row lock:

- ``skipped``: distinct groups of the job the ledger marks zero-variance;
- ``replaced``: replacement groups already started, read from the episodes themselves:
  the first ``episodes_per_iteration`` episodes of an iteration are its own, every
  episode past them belongs to a replacement group.

A replacement is due while ``skipped > replaced``; starting it writes the episodes that
raise ``replaced`` in the same transaction. Both counts are facts in the database, so a
trainer that crashes and marks the same group again, or a dispatcher replica that takes
over the job, starts no replacement twice and loses none.

Replacement groups are drawn like any group of the current iteration (a fresh task by
the curriculum, not the skipped group's task again): a task every sample solved or none
did would most likely give zero variance again, and the ``learnable`` curriculum already
weighs such settled tasks down. ``algorithm.max_replacement_groups`` bounds the
replacements of one iteration, so a task set that never gives a signal cannot loop: past
the bound, the job goes on and the unreplaced skips stay counted.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import SKIPPED_ZERO_VARIANCE, TrainedTrajectory


def replacement_groups(started: int, per_iteration: int, group_size: int) -> int:
    """Replacement groups among an iteration's ``started`` episodes."""
    extra = max(0, started - per_iteration)
    return -(-extra // group_size)


def replacements_due(
    *,
    skipped: int,
    started: Mapping[int, int],
    iteration: int,
    per_iteration: int,
    group_size: int,
    max_per_iteration: int,
) -> int:
    """Replacement groups to start now in ``iteration``: one per unreplaced skip, at most
    ``max_per_iteration`` in one iteration."""
    replaced = sum(replacement_groups(n, per_iteration, group_size) for n in started.values())
    here = replacement_groups(started.get(iteration, 0), per_iteration, group_size)
    return max(0, min(skipped - replaced, max_per_iteration - here))


async def zero_variance_groups(s: AsyncSession, job_id: str) -> int:
    """Distinct groups of the job the trainer skipped for zero reward variance."""
    query = select(func.count(func.distinct(TrainedTrajectory.group_id))).where(
        TrainedTrajectory.job_id == job_id, TrainedTrajectory.skipped == SKIPPED_ZERO_VARIANCE
    )
    return int(await s.scalar(query) or 0)
