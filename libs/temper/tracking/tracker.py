"""What a job's lifecycle events become in its tracking runs. One :class:`Tracker` serves
every job; a job is tracked only when its spec has ``tracking:``.

| event | logged |
|---|---|
| first event of the job | a run (MLflow: found again by its ``temper.job_id`` tag), its tags (tenant, job id and name, Temper's version), the resolved spec as params (:func:`temper.tracking.params.flatten`, secrets redacted) |
| ``policy.version`` | every number the trainer published with the version (``train/loss``, ``train/kl``, ``train/entropy``, ``train/grad_norm``, ``train/clip_fraction``, ``train/learning_rate``, ``train/tokens``, ...), step = version |
| ``episode.reward`` | the iteration's reward so far from the database: ``rollout/reward_mean``, ``rollout/reward_std``, ``rollout/episodes``, step = iteration |
| ``job.state`` | tags ``temper.state`` and ``temper.state_reason``, the run's status; at an end, every iteration's reward again, as the database holds it then |

Every point's timestamp is its event's ``occurred_at``: a redelivered event logs the same
points, which the servers keep once. A tracking server that cannot be reached raises a
``ConnectionError``, so the bus holds the record and retries it with backoff until the
server answers (docs/tracking.md)."""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from temper import __version__
from temper.db import Database, Episode, Job
from temper.events import LifecycleEvent
from temper.jobspec import Tracking
from temper.lifecycle import JOB_TERMINAL
from temper.lifecycle import EpisodeState as E
from temper.tracking.mlflow import RUN_STATUS, MlflowRuns
from temper.tracking.params import flatten

SCORED = (E.scored.value, E.trained.value)
ENDS = {state.value for state in JOB_TERMINAL}
CACHED_JOBS = 1000

Point = tuple[str, float, int, int]  # key, value, timestamp ms, step


@dataclass(frozen=True)
class TrackedJob:
    id: str
    tenant: str
    name: str
    tracking: Tracking
    params: dict[str, str]

    @property
    def tags(self) -> dict[str, str]:
        return {"temper.tenant": self.tenant, "temper.job_name": self.name, "temper.version": __version__,
                "mlflow.runName": self.name}  # fmt: skip


def _ms(event: LifecycleEvent) -> int:
    return int(event.occurred_at.timestamp() * 1000)


def version_points(event: LifecycleEvent) -> list[Point]:
    """The trainer's numbers of a ``policy.version`` event as ``train/<name>`` at step = version."""
    assert event.version is not None
    ts = _ms(event)
    return [
        (f"train/{k}", float(v), ts, event.version)
        for k, v in sorted(event.data.items())
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


async def iteration_rewards(
    db: Database, job_id: str, iteration: int | None = None
) -> dict[int, tuple[int, float, float]]:
    """iteration -> (scored episodes, mean reward, population std), as the database holds them
    (the same numbers as ``GET /v1/jobs/{id}/metrics``' curve)."""
    query = (
        select(
            Episode.iteration,
            func.count(),
            func.avg(Episode.reward),
            func.avg(Episode.reward * Episode.reward),
        )
        .where(Episode.job_id == job_id, Episode.state.in_(SCORED), Episode.reward.is_not(None))
        .group_by(Episode.iteration)
    )
    if iteration is not None:
        query = query.where(Episode.iteration == iteration)
    async with db.session() as s:
        rows = (await s.execute(query)).all()
    return {
        it: (n, float(mean), math.sqrt(max(0.0, float(sq) - float(mean) ** 2))) for it, n, mean, sq in rows
    }


def reward_points(stats: dict[int, tuple[int, float, float]], ts: int) -> list[Point]:
    out: list[Point] = []
    for it, (n, mean, std) in sorted(stats.items()):
        out += [("rollout/reward_mean", mean, ts, it), ("rollout/reward_std", std, ts, it),
                ("rollout/episodes", float(n), ts, it)]  # fmt: skip
    return out


class Tracker:
    """Log lifecycle events to the tracking runs their jobs ask for."""

    def __init__(self, db: Database, *, mlflow: MlflowRuns | None = None) -> None:
        self.db = db
        self.mlflow = mlflow or MlflowRuns()
        self._jobs: OrderedDict[str, TrackedJob | None] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def aclose(self) -> None:
        await self.mlflow.aclose()

    async def job(self, job_id: str) -> TrackedJob | None:
        """The job, if its spec asks for tracking (cached: a spec does not change)."""
        if job_id in self._jobs:
            return self._jobs[job_id]
        async with self.db.session() as s:
            row = await s.get(Job, job_id)
            found = None
            if row is not None:
                tracking = tracking_of(row.spec or {})
                if tracking.mlflow is not None or tracking.wandb is not None:
                    found = TrackedJob(row.id, row.tenant_id, row.name, tracking, flatten(row.spec or {}))
        if row is not None:  # a job not yet visible is looked up again next time
            self._jobs[job_id] = found
            while len(self._jobs) > CACHED_JOBS:
                self._jobs.popitem(last=False)
        return found

    async def handle(self, event: LifecycleEvent) -> None:
        if event.job_id is None:
            return
        job = await self.job(event.job_id)
        if job is None:
            return
        points, tags, status = await self._what(job, event)
        if not points and not tags:
            return
        lock = self._locks.setdefault(job.id, asyncio.Lock())  # one run per job, never two creates
        async with lock:
            if job.tracking.mlflow is not None:
                await self._to_mlflow(job, event, points, tags, status)

    async def _what(
        self, job: TrackedJob, event: LifecycleEvent
    ) -> tuple[list[Point], dict[str, str], str | None]:
        """The points, tags and run status an event logs."""
        ts = _ms(event)
        if event.event == "policy.version" and event.version is not None:
            return version_points(event), {}, None
        if event.event == "episode.reward" and isinstance(event.data.get("iteration"), int):
            return (
                reward_points(await iteration_rewards(self.db, job.id, event.data["iteration"]), ts),
                {},
                None,
            )
        if event.event == "job.state" and event.state is not None:
            tags = {"temper.state": event.state, "temper.state_reason": event.reason or ""}
            points = (
                reward_points(await iteration_rewards(self.db, job.id), ts) if event.state in ENDS else []
            )
            return points, tags, RUN_STATUS.get(event.state)
        return [], {}, None

    async def _to_mlflow(
        self,
        job: TrackedJob,
        event: LifecycleEvent,
        points: list[Point],
        tags: dict[str, str],
        status: str | None,
    ) -> None:
        spec = job.tracking.mlflow
        assert spec is not None
        run_id = await self.mlflow.run_id(
            spec.uri, spec.experiment, job_id=job.id, name=job.name, start_ms=_ms(event), tags=job.tags,
            params=job.params,
        )  # fmt: skip
        client = self.mlflow.client(spec.uri)
        if points:
            await client.log_batch(run_id, metrics=points)
        if status is not None:
            end = _ms(event) if status != "RUNNING" else None
            await client.update_run(run_id, status=status, end_ms=end)
        if tags:  # last: a reader that sees temper.state sees the points and status before it
            await client.log_batch(run_id, tags=tags)


def tracking_of(spec: dict[str, Any]) -> Tracking:
    """The ``tracking:`` section of a stored spec."""
    return Tracking.model_validate(spec.get("tracking") or {})
