"""The trainer's ledger (``trained_trajectories``, one row per episode): the durable side of
its buffer, and the reasons a trajectory was not trained on.

- a received trajectory gets a row with ``step = NULL`` before its offset is committed, so
  the buffer survives a crash and is reloaded on start (:func:`buffered_rows`);
- a row gets its ``step`` only in the transaction that publishes the version holding that
  step's update (:func:`services.trainer.publishing.publish`);
- a row gets ``skipped`` = one of the reasons below when its group is not trained on.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import (
    SKIPPED_JOB_ENDED,
    SKIPPED_STALE,
    SKIPPED_ZERO_VARIANCE,
    Database,
    Episode,
    TrainedTrajectory,
)
from temper.lifecycle import EPISODE_FINISHED, EpisodeState

SKIP_ZERO_VARIANCE = SKIPPED_ZERO_VARIANCE  # read by the dispatcher (dynamic sampling)
SKIP_STALE = SKIPPED_STALE
SKIP_JOB_ENDED = SKIPPED_JOB_ENDED
SKIP_INCOMPLETE = "incomplete_group"
SKIP_MISSING = "trajectory_missing"
SKIP_NO_UPDATE = "no_update"  # the step produced a non-finite gradient and was dropped
SKIP_MISMATCH = "logprob_mismatch"  # the canary refused the batch (algorithm.mismatch.on_mismatch: skip)
SKIP_TRAIN_ERROR = "train_error"  # the step raised (e.g. a token id outside the vocabulary)


async def add_row(db: Database, row: TrainedTrajectory) -> bool:
    """Write one ledger row in its own transaction; False if the episode has one already."""
    return await add_rows(db, [row])


async def add_rows(db: Database, rows: list[TrainedTrajectory]) -> bool:
    """Write ledger rows in one transaction; False (none written) if an episode has one already."""
    try:
        async with db.session() as s:
            s.add_all(rows)
    except IntegrityError:
        return False
    return True


async def with_rows(db: Database, episode_ids: list[str]) -> set[str]:
    """Of ``episode_ids``, those already buffered, trained on or skipped."""
    async with db.session() as s:
        found = await s.scalars(
            select(TrainedTrajectory.episode_id).where(TrainedTrajectory.episode_id.in_(episode_ids))
        )
        return set(found)


async def has_row(db: Database, episode_id: str) -> bool:
    """Whether the episode is already buffered, trained on or skipped."""
    async with db.session() as s:
        return await s.get(TrainedTrajectory, episode_id) is not None


async def mark_skipped(db: Database, episodes: list[str], reason: str) -> None:
    async with db.session() as s:
        await s.execute(
            update(TrainedTrajectory).where(TrainedTrajectory.episode_id.in_(episodes)).values(skipped=reason)
        )


async def closed_groups(db: Database, job_id: str, group_ids: list[str]) -> set[str]:
    """Of ``group_ids``, the groups nothing more will come for: every episode of theirs has
    finished and every scored one's trajectory has its row here. A group whose other members
    failed or were cancelled (a cancelled job, say) is closed at once instead of waiting out
    ``group_timeout_s``. A group with no episode rows (a trajectory sent from elsewhere) is
    never closed here; the timeout still applies to it."""
    if not group_ids:
        return set()
    query = (
        select(
            Episode.group_id,
            Episode.state,
            Episode.trajectory_key.is_not(None),
            TrainedTrajectory.episode_id.is_not(None),
        )
        .outerjoin(TrainedTrajectory, TrainedTrajectory.episode_id == Episode.id)
        .where(Episode.job_id == job_id, Episode.group_id.in_(group_ids))
    )
    known: set[str] = set()
    still_open: set[str] = set()
    async with db.session() as s:
        for group_id, state, has_trajectory, recorded in await s.execute(query):
            known.add(group_id)
            if state not in EPISODE_FINISHED or (
                state == EpisodeState.scored and has_trajectory and not recorded
            ):
                still_open.add(group_id)
    return known - still_open


async def jobs_with_buffered(db: Database, job_id: str | None = None) -> list[str]:
    """The jobs that have received, untrained trajectories (all, or only ``job_id``)."""
    query = (
        select(TrainedTrajectory.job_id)
        .where(TrainedTrajectory.step.is_(None), TrainedTrajectory.skipped.is_(None))
        .distinct()
    )
    if job_id:
        query = query.where(TrainedTrajectory.job_id == job_id)
    async with db.session() as s:
        return list((await s.execute(query)).scalars())


async def buffered_rows(session: AsyncSession, job_id: str) -> list[TrainedTrajectory]:
    """A job's buffered rows in the order they arrived."""
    query = (
        select(TrainedTrajectory)
        .where(
            TrainedTrajectory.job_id == job_id,
            TrainedTrajectory.step.is_(None),
            TrainedTrajectory.skipped.is_(None),
        )
        .order_by(TrainedTrajectory.created_at, TrainedTrajectory.episode_id)
    )
    return list((await session.execute(query)).scalars())


async def record_steps(session: AsyncSession, steps: dict[str, int]) -> None:
    """Give each episode (``{episode id: step}``) the step that trained on it."""
    by_step: dict[int, list[str]] = {}
    for episode, step in steps.items():
        by_step.setdefault(step, []).append(episode)
    for step, episodes in by_step.items():
        await session.execute(
            update(TrainedTrajectory).where(TrainedTrajectory.episode_id.in_(episodes)).values(step=step)
        )
