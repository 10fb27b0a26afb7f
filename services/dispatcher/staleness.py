"""The staleness gate: may the scheduler start an iteration's episodes now, given how far
the trainer is behind them and which version the gateway serves, so that none is trained
more than ``schedule.max_staleness`` versions after the one that sampled it? And has the
trainer read everything it will train on (a job waiting for its training to complete)?"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.placement import served_version_query
from temper.db import Episode, Job, TrainedTrajectory
from temper.jobspec import JobSpec
from temper.lifecycle import EpisodeState

E = EpisodeState


def trained_at(spec: JobSpec, version: int, untrained_groups: int) -> int:
    """The trainer's version when it steps on the last group of an iteration started now:
    ``version`` (its newest) plus one for every ``groups_per_step x checkpoint_every`` groups
    ahead of that group (the ``untrained_groups`` of earlier iterations, then the
    iteration's own)."""
    own = math.ceil(spec.schedule.episodes_per_iteration / spec.tasks.group_size)
    per_version = spec.algorithm.groups_per_step * spec.algorithm.checkpoint_every
    return version + (untrained_groups + own - 1) // per_version


def untrained_groups_query(job_id: str, before_iteration: int) -> Select[Any]:
    """Groups of earlier iterations that the trainer has yet to step on (not trained or skipped)."""
    return (
        select(func.count(func.distinct(Episode.group_id)))
        .select_from(Episode)
        .outerjoin(TrainedTrajectory, TrainedTrajectory.episode_id == Episode.id)
        .where(
            Episode.job_id == job_id,
            Episode.iteration < before_iteration,
            Episode.state.not_in([E.trained, E.failed, E.cancelled]),
            or_(
                TrainedTrajectory.episode_id.is_(None),
                and_(TrainedTrajectory.step.is_(None), TrainedTrajectory.skipped.is_(None)),
            ),
        )
    )


async def gate_inputs(s: AsyncSession, job_id: str, iteration: int) -> tuple[int, int, int]:
    """The job's policy version, the groups the trainer has yet to step on ahead of
    ``iteration``, and the version the gateway serves, read in one statement. The trainer
    writes its ledger rows and the version in one transaction; read by separate statements,
    a commit between them gave the gate the new ledger with the old version (SQLite reads
    outside a snapshot), and it opened an iteration the bound held."""
    query = select(
        Job.policy_version,
        untrained_groups_query(job_id, iteration).scalar_subquery(),
        served_version_query(job_id).scalar_subquery(),
    ).where(Job.id == job_id)
    version, untrained, served = (await s.execute(query)).one()
    return int(version), int(untrained or 0), int(served or 0)


async def fresh_enough(s: AsyncSession, job: Job, spec: JobSpec, iteration: int) -> bool:
    """May episodes of ``iteration`` start? They are generated on at least the version the
    gateway serves the job now (confirmed by its backends,
    :func:`services.dispatcher.placement.served_version_query`; not the trainer's newest,
    which the gateway may not have loaded yet), and trained once the trainer has stepped
    through the groups still ahead of them: from the trainer's own progress, at its version
    now plus one version per ``groups_per_step x checkpoint_every`` groups ahead
    (:func:`trained_at`). The gap must stay within ``max_staleness``, or the trainer would
    drop them as stale. (Counting versions from the iteration number instead held every
    iteration until the one before had trained once a group was skipped: skipped groups make
    fewer steps than iterations.) If the gateway serves the trainer's version and the
    trainer holds too few groups to make a step, waiting would deadlock, so the gate opens."""
    version, untrained, served = await gate_inputs(s, job.id, iteration)
    if version != job.policy_version:  # the trainer committed one since this pass read the job
        return False  # the next pass decides on it
    if trained_at(spec, version, untrained) - served <= spec.schedule.max_staleness:
        return True
    return served >= version and untrained < spec.algorithm.groups_per_step


async def training_done(s: AsyncSession, job: Job, spec: JobSpec) -> bool:
    """The trainer has read every scored episode and cannot step again without more."""
    unseen = await s.scalar(
        select(func.count())
        .select_from(Episode)
        .outerjoin(TrainedTrajectory, TrainedTrajectory.episode_id == Episode.id)
        .where(Episode.job_id == job.id, Episode.state == E.scored, TrainedTrajectory.episode_id.is_(None))
    )
    if unseen:
        return False
    untrained = int(await s.scalar(untrained_groups_query(job.id, spec.schedule.iterations)) or 0)
    return untrained < spec.algorithm.groups_per_step
