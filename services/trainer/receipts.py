"""Receiving trajectories: each is buffered durably (a ledger row) before its offset is
committed, and a redelivery is a no-op.

The trainer's consumer hands over trajectories of different episodes side by side; those
handed over while a receipt's transaction runs go through the next one together
(:class:`temper.group_commit.GroupCommit`): one read of which episodes already have rows,
the trajectories fetched at once, one insert of every new row. At 72 episodes an
iteration that is a few transactions instead of two for each trajectory, on the same
event loop that scores the episodes. A batch with anything unusual in it (a job this
process does not train, a closed job, a trajectory that does not parse, a row that
raced in) runs each trajectory alone, as one call would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from services.trainer import ledger
from services.trainer.buffer import Buffered, TrainingJob
from services.trainer.ledger import SKIP_JOB_ENDED
from temper.bus import Poison
from temper.db import Database, TrainedTrajectory
from temper.events import TrajectoryReady
from temper.group_commit import GroupCommit
from temper.logs import log_event
from temper.settings.trainer import TrainerSettings
from temper.storage import ObjectStore
from temper.trajectory import Trajectory

log = logging.getLogger("temper.trainer")


class UnknownJob(Poison):
    """A trajectory of a job this database does not hold."""


class _Unusual(Exception):
    """A batch that is not all plain, new trajectories of one open job: each goes alone."""


class Receipts:
    """The trainer's receiving half: its jobs, the jobs it closed or does not hold, how it
    loads a job, and the event that wakes its training loop are the trainer's."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: TrainerSettings,
        *,
        jobs: dict[str, TrainingJob],
        closed_jobs: set[str],
        foreign_jobs: set[str],
        load_job: Callable[[str], Awaitable[TrainingJob]],
        wake: asyncio.Event,
        max_batch: int = 256,
    ) -> None:
        self.db, self.store, self.settings = db, store, settings
        self.jobs, self.closed_jobs, self.foreign_jobs = jobs, closed_jobs, foreign_jobs
        self.load_job = load_job
        self.wake = wake
        self.batches: GroupCommit[TrajectoryReady] = GroupCommit(
            self._take, key=lambda m: m.episode_id, max_batch=max_batch, parallel=1
        )

    async def receive(self, message: TrajectoryReady) -> None:
        """Buffer ``message``'s trajectory (with whatever else is handed over now) and wake
        the training loop; returns once its ledger row is committed."""
        await self.batches.take([message])

    async def close(self) -> None:
        await self.batches.close()

    async def _take(self, messages: list[TrajectoryReady]) -> None:
        if len(messages) == 1:
            await self.one(messages[0])
            return
        try:
            await self._many(messages)
        except _Unusual:
            for message in messages:
                await self.one(message)

    async def _many(self, messages: list[TrajectoryReady]) -> None:
        """One job's new trajectories in one transaction; :class:`_Unusual` (nothing done)
        when they are not that."""
        job_id = messages[0].job_id
        if (
            not job_id
            or any(m.job_id != job_id or not m.episode_id for m in messages)
            or (self.settings.job_id and job_id != self.settings.job_id)
            or job_id in self.closed_jobs
            or job_id not in self.jobs  # loaded by a first trajectory on its own
        ):
            raise _Unusual
        job = self.jobs[job_id]
        async with job.lock:
            if job_id in self.closed_jobs:
                raise _Unusual
            ids = [m.episode_id or "" for m in messages]
            held = {i for i in ids if job.holds(i)} | await ledger.with_rows(self.db, ids)
            new = [m for m in messages if m.episode_id not in held]
            raws = await asyncio.gather(*(self.store.get(m.trajectory_key) for m in new))
            items: list[Buffered] = []
            for message, raw in zip(new, raws, strict=True):
                try:
                    trajectory = Trajectory.model_validate_json(raw)
                except ValidationError:
                    raise _Unusual from None
                if trajectory.episode_id != message.episode_id or trajectory.job_id != job_id:
                    raise _Unusual
                items.append(Buffered(trajectory, message.trajectory_key, time.time()))
            rows = [
                TrainedTrajectory(
                    episode_id=b.trajectory.episode_id,
                    job_id=job_id,
                    trajectory_key=b.key,
                    group_id=b.trajectory.group_id,
                )
                for b in items
            ]
            if rows and not await ledger.add_rows(self.db, rows):
                raise _Unusual  # a concurrent delivery of one of them won
            for b in items:
                job.add(b)
        self.wake.set()

    async def one(self, message: TrajectoryReady) -> None:
        """Buffer one trajectory (a ledger row) and wake the training loop."""
        if self.settings.job_id and message.job_id != self.settings.job_id:
            return
        if not message.job_id or not message.episode_id:
            raise Poison("trajectory.ready without job_id or episode_id")
        if message.job_id in self.closed_jobs:
            await self.after_end(message)
            return
        try:
            job: TrainingJob = await self.load_job(message.job_id)
        except UnknownJob:
            # Topics can be shared by deployments (or test runs) with their own databases:
            # another one's trajectory is not ours to train on, nor a dead letter.
            if message.job_id not in self.foreign_jobs:
                self.foreign_jobs.add(message.job_id)
                log_event(log, "trajectories of an unknown job ignored", job_id=message.job_id)
            return
        async with job.lock:
            if message.job_id in self.closed_jobs:  # closed while this waited for the lock
                await self.after_end(message)
                return
            if job.holds(message.episode_id):
                return
            if await ledger.has_row(self.db, message.episode_id):
                return  # already buffered, trained on or skipped
            raw = await self.store.get(message.trajectory_key)  # NotFound: retried, then dead-lettered
            try:
                trajectory = Trajectory.model_validate_json(raw)
            except ValidationError as exc:
                raise Poison(
                    f"{message.trajectory_key} is not a trajectory: {exc.errors()[0]['msg']}"
                ) from None
            if trajectory.episode_id != message.episode_id or trajectory.job_id != message.job_id:
                raise Poison(f"{message.trajectory_key} belongs to another episode or job")
            row = TrainedTrajectory(
                episode_id=trajectory.episode_id,
                job_id=job.job_id,
                trajectory_key=message.trajectory_key,
                group_id=trajectory.group_id,
            )
            if not await ledger.add_row(self.db, row):
                return  # a concurrent delivery of the same episode won
            job.add(Buffered(trajectory, message.trajectory_key, time.time()))
        self.wake.set()

    async def after_end(self, message: TrajectoryReady) -> None:
        """A trajectory of a job already completed (a redelivery, or one scored after the
        job's last step): its ledger row says so, and nothing is loaded for it. An episode
        that already has a row keeps it."""
        await ledger.add_row(
            self.db,
            TrainedTrajectory(
                episode_id=message.episode_id,
                job_id=message.job_id,
                trajectory_key=message.trajectory_key,
                group_id=message.group_id,
                skipped=SKIP_JOB_ENDED,
            ),
        )
