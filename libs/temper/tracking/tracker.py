"""What a job's lifecycle events become in its tracking runs. One :class:`Tracker` serves
every job; a job is tracked only when its spec has ``tracking:``. The tracker works out what
an event logs (an :class:`temper.tracking.model.Update`) once, and hands it to each system the
job's spec names (:class:`temper.tracking.mlflow.MlflowSink`,
:class:`temper.tracking.wandb_offline.WandbSink`), which only translate it.

| event | logged |
|---|---|
| first event of the job | a run (MLflow: found again by its ``temper.job_id`` tag; W&B: id = the job's id), its tags (tenant, job id and name, Temper's version), the resolved spec and the job's provenance (``provenance.*``) as params (:func:`temper.tracking.params.flatten`, secrets redacted) |
| ``policy.version`` | every number the trainer published with the version (``train/loss``, ``train/kl``, ``train/entropy``, ``train/grad_norm``, ``train/clip_fraction``, ``train/learning_rate``, ``train/tokens``, ...), step = version |
| ``episode.reward`` | the iteration's reward so far from the database: ``rollout/reward_mean``, ``rollout/reward_std``, ``rollout/episodes``, step = iteration |
| ``evaluation`` | an evaluation's results of a version: ``eval/pass_at_<k>`` for each k, ``eval/reward_mean``, ``eval/episodes``, ``eval/<component>`` (each reward component's mean), under ``eval/<label>/`` for a label other than ``eval``; step = the version evaluated |
| ``job.state`` | tags ``temper.state`` and ``temper.state_reason``, the run's status; at an end, every iteration's reward again, as the database holds it then |

Every point's timestamp is its event's ``occurred_at``: a redelivered event logs the same
points, which MLflow keeps once and W&B does not write again (it writes a row only for values
its run lacks). A tracking server that cannot be reached raises a
``ConnectionError``, so the bus holds the record and retries it with backoff until the
server answers (docs/tracking.md)."""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from temper.clock import utcnow
from temper.db import Database, Episode, Evaluation, Job, PolicyVersion
from temper.events import LifecycleEvent
from temper.jobspec import Tracking
from temper.lifecycle import JOB_TERMINAL
from temper.lifecycle import EpisodeState as E
from temper.tracking.mlflow import MlflowRuns, MlflowSink
from temper.tracking.model import Point, Sink, TrackedJob, Update
from temper.tracking.params import flatten, flatten_values
from temper.tracking.wandb_offline import WandbSink

SCORED = (E.scored.value, E.trained.value)
ENDS = {state.value for state in JOB_TERMINAL}
CACHED_JOBS = 1000


def _ms(event: LifecycleEvent) -> int:
    return int(event.occurred_at.timestamp() * 1000)


def train_points(version: int, numbers: dict[str, Any], ts: int) -> list[Point]:
    """The trainer's numbers of a version as ``train/<name>`` at step = version."""
    return [
        (f"train/{k}", float(v), ts, version)
        for k, v in sorted(numbers.items())
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


def version_points(event: LifecycleEvent) -> list[Point]:
    """The trainer's numbers of a ``policy.version`` event as ``train/<name>`` at step = version."""
    assert event.version is not None
    return train_points(event.version, event.data, _ms(event))


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


def eval_points(version: int, label: str, results: dict[str, Any], ts: int) -> list[Point]:
    """An evaluation's results of ``version`` (``temper.evaluation.summary``) at step = version:
    ``eval/pass_at_<k>`` (MLflow's metric names allow no ``@``), ``eval/reward_mean``,
    ``eval/episodes`` and ``eval/<component>``; ``eval/<label>/...`` for another label."""
    prefix = "eval/" if label == "eval" else f"eval/{label}/"
    values: dict[str, Any] = {
        **{f"pass_at_{k}": v for k, v in (results.get("pass_at") or {}).items()},
        "reward_mean": results.get("reward_mean"),
        "episodes": results.get("episodes"),
        **{
            f"{name}": v for name, v in (results.get("components") or {}).items() if name not in ("episodes",)
        },
    }
    return [
        (prefix + key, float(v), ts, version)
        for key, v in sorted(values.items())
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


def reward_points(stats: dict[int, tuple[int, float, float]], ts: int) -> list[Point]:
    out: list[Point] = []
    for it, (n, mean, std) in sorted(stats.items()):
        out += [("rollout/reward_mean", mean, ts, it), ("rollout/reward_std", std, ts, it),
                ("rollout/episodes", float(n), ts, it)]  # fmt: skip
    return out


class Tracker:
    """Log lifecycle events to the tracking runs their jobs ask for: ``sinks`` are the
    systems (default: MLflow, and W&B offline under ``wandb_dir``)."""

    def __init__(
        self,
        db: Database,
        *,
        mlflow: MlflowRuns | None = None,
        wandb_dir: Path = Path(".temper/wandb"),
        wandb_flush_s: float = 2.0,
        wandb_end_grace_s: float = 30.0,
        sinks: list[Sink] | None = None,
    ) -> None:
        self.db = db
        self.sinks: list[Sink] = sinks if sinks is not None else [
            MlflowSink(mlflow),
            WandbSink(wandb_dir, flush_s=wandb_flush_s, end_grace_s=wandb_end_grace_s, backfill=self.history),
        ]  # fmt: skip
        self._jobs: OrderedDict[str, TrackedJob | None] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def aclose(self) -> None:
        for sink in self.sinks:
            await sink.aclose()

    async def job(self, job_id: str) -> TrackedJob | None:
        """The job, if its spec asks for tracking (cached: a spec does not change)."""
        if job_id in self._jobs:
            return self._jobs[job_id]
        async with self.db.session() as s:
            row = await s.get(Job, job_id)
            found = None
            if row is not None:
                spec = row.spec or {}
                tracking = tracking_of(spec)
                if tracking.mlflow is not None or tracking.wandb is not None:
                    labels = tuple(str(t) for t in spec.get("tags") or ())
                    logged = {**spec, **provenance_params(row.provenance)}
                    found = TrackedJob(row.id, row.tenant_id, row.name, tracking, flatten(logged),
                                       flatten_values(logged), labels)  # fmt: skip
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
        update = await self.update(job, event)
        if not update:
            return
        lock = self._locks.setdefault(job.id, asyncio.Lock())  # one run per job, never two creates
        async with lock:
            for sink in self.sinks:
                if sink.wants(job):
                    await sink.log(job, update)

    async def update(self, job: TrackedJob, event: LifecycleEvent) -> Update:
        """What an event logs: its points, tags and (on ``job.state``) the job's state."""
        ts = _ms(event)
        if event.event == "policy.version" and event.version is not None:
            return Update(version_points(event), {}, None, ts)
        if event.event == "evaluation" and event.version is not None:  # a model directory's has no step
            return Update(
                eval_points(event.version, str(event.data.get("label") or "eval"), event.data, ts),
                {},
                None,
                ts,
            )
        if event.event == "episode.reward" and isinstance(event.data.get("iteration"), int):
            stats = await iteration_rewards(self.db, job.id, event.data["iteration"])
            return Update(reward_points(stats, ts), {}, None, ts)
        if event.event == "job.state" and event.state is not None:
            tags = {"temper.state": event.state, "temper.state_reason": event.reason or ""}
            points = (
                reward_points(await iteration_rewards(self.db, job.id), ts) if event.state in ENDS else []
            )
            return Update(points, tags, event.state, ts)
        return Update([], {}, None, ts)

    async def history(self, job: TrackedJob) -> list[Point]:
        """Every point the database holds for the job now: each version's numbers (at the
        version's time), each finished evaluation's results (at its end) and each iteration's
        reward. A system that may have missed some (W&B, the first time a process sees the job)
        logs those it lacks."""
        async with self.db.session() as s:
            versions = (
                await s.execute(
                    select(PolicyVersion.version, PolicyVersion.metrics, PolicyVersion.created_at)
                    .where(PolicyVersion.job_id == job.id)
                    .order_by(PolicyVersion.version)
                )
            ).all()
            evaluations = (
                await s.execute(
                    select(Evaluation.version, Evaluation.label, Evaluation.summary, Evaluation.completed_at)
                    .where(
                        Evaluation.source_job_id == job.id,
                        Evaluation.version.is_not(None),
                        Evaluation.completed_at.is_not(None),
                    )
                    .order_by(Evaluation.completed_at)
                )
            ).all()
        points: list[Point] = []
        for version, metrics, created in versions:
            if version > 0 and metrics:
                points += train_points(version, metrics, int(created.timestamp() * 1000))
        for version, label, summary, completed in evaluations:
            points += eval_points(version, label, summary or {}, int(completed.timestamp() * 1000))
        now = int(utcnow().timestamp() * 1000)
        return points + reward_points(await iteration_rewards(self.db, job.id), now)


def provenance_params(provenance: dict[str, Any] | None) -> dict[str, Any]:
    """The job's provenance (``jobs.provenance``) as params beside its spec, under
    ``provenance.``: ``provenance.spec_sha256``, ``provenance.seeds.tasks.seed``,
    ``provenance.temper.commit``, ``provenance.model.sha256``, ``provenance.taskset.sha256``, …
    (its format number and time left out)."""
    if not provenance:
        return {}
    return {"provenance": {k: v for k, v in provenance.items() if k not in ("format", "recorded_at")}}


def tracking_of(spec: dict[str, Any]) -> Tracking:
    """The ``tracking:`` section of a stored spec."""
    return Tracking.model_validate(spec.get("tracking") or {})
