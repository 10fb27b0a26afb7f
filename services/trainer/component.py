"""The trainer: trajectories in, policy versions out.

:class:`Trainer` consumes ``trajectories`` (each message names a Trajectory JSON in
object storage), gathers them into groups (same task, ``tasks.group_size`` samples),
and makes one GRPO step (:class:`temper.training.Learner`) whenever
``algorithm.groups_per_step`` groups are ready. Every ``algorithm.checkpoint_every``
steps it writes a checkpoint to object storage and, in one database transaction, the
``policy_versions`` row, the ledger entries of the trajectories those steps used, the
job's ``policy_version`` and the ``policy.updates`` message (through the outbox).

The ledger (``trained_trajectories``, one row per episode) is what makes a crash safe:

- a received trajectory gets a row with ``step = NULL`` before its offset is committed,
  so the buffer survives a crash and is reloaded on start;
- a row gets its ``step`` only in the transaction that publishes the checkpoint holding
  that step's update; a crash between a step and its checkpoint loses the update and the
  ledger still says "buffered", so the trajectory is trained on again, once, from the
  restored checkpoint;
- a redelivered message whose episode already has a row is ignored;
- a group not trained on gets ``skipped`` = the reason, in its own transaction;
- what a job still buffers when the dispatcher completes it (too few groups for a step,
  say after a stale group was dropped) gets ``skipped: job_ended``, and the job's learner
  is let go (:meth:`Trainer.close_completed_jobs`).

One trainer owns a job: run one trainer process for all jobs (consumer group
``trainer``), or one per job with ``TEMPER_TRAINER__JOB_ID`` (group ``trainer.<job>``).
Two trainers on one job would each hold part of its groups.

LoRA jobs on the same base model share one copy of it in the trainer process
(:class:`temper.training.lora.SharedBase`, keyed by :func:`base_key`): each job holds its
adapter and that adapter's AdamW state, and the jobs step in turn.

Under ``torchrun`` this class runs on rank 0 only; every learner operation with
collectives (load, step, publish) is opened with a command to the other ranks
(:mod:`services.trainer.ranks`, :mod:`services.trainer.follower`), and the model is
sharded over all of them (:func:`build_learner`).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from services.trainer import handlers
from services.trainer.observe import init_job_metrics, observe_step
from services.trainer.ranks import Ranks
from temper import metrics, registry
from temper.bus import Consumer, Poison
from temper.bus.errors import DATABASE, NETWORK, OBJECT_STORE, unavailable_dependency
from temper.db import (
    SKIPPED_JOB_ENDED,
    SKIPPED_STALE,
    SKIPPED_ZERO_VARIANCE,
    Job,
    PolicyVersion,
    TrainedTrajectory,
)
from temper.events import LifecycleEvent, PolicyUpdate, Topics, TrajectoryReady
from temper.jobspec import JobSpec
from temper.lifecycle import mark_job_stuck
from temper.logs import dependency_failed, dependency_recovered, log_context, log_event
from temper.outbox import OutboxRelay, enqueue
from temper.policy import (
    ChatTokenizer,
    create_model,
    default_tokenizer,
    is_model_dir,
    load_causal_lm,
    load_weights,
)
from temper.runtime import Runtime
from temper.storage import NotFound, ObjectStore
from temper.training import Learner, LearnerConfig, StepStats, TrainerSettings, is_zero_variance, pick_device
from temper.training.distributed import DCP_DIR, agree, shard
from temper.training.lora import SharedBase
from temper.trajectory import Trajectory

log = logging.getLogger("temper.trainer")

SKIP_ZERO_VARIANCE = SKIPPED_ZERO_VARIANCE  # read by the dispatcher (dynamic sampling)
SKIP_STALE = SKIPPED_STALE
SKIP_JOB_ENDED = SKIPPED_JOB_ENDED
SKIP_INCOMPLETE = "incomplete_group"
SKIP_MISSING = "trajectory_missing"
SKIP_NO_UPDATE = "no_update"  # the step produced a non-finite gradient and was dropped
SKIP_TRAIN_ERROR = "train_error"  # the step raised (e.g. a token id outside the vocabulary)

ModelFactory = Callable[[JobSpec], torch.nn.Module]


class UnknownJob(Poison):
    """A trajectory of a job this database does not hold."""


@dataclass
class Buffered:
    trajectory: Trajectory
    key: str
    arrived: float  # unix time the ledger row was written

    @property
    def episode_id(self) -> str:
        return self.trajectory.episode_id


@dataclass
class JobState:
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


class Trainer:
    """The trainer component (see the module docstring). ``model_factory`` builds a job's
    initial policy; by default it comes from ``policy.init`` (a local model directory or
    an object-store key) or the ``TEMPER_TRAINER__PRESET`` preset."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        settings: TrainerSettings | None = None,
        model_factory: ModelFactory | None = None,
        on_step: Callable[[str, StepStats], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.settings = settings or runtime.settings.trainer
        self.model_factory = model_factory
        self.on_step = on_step
        self.jobs: dict[str, JobState] = {}
        self.relay: OutboxRelay | None = None
        self.consumer: Consumer | None = None
        self.device = pick_device(self.settings.device)
        # torchrun's ranks: with more than one, this process is rank 0 (the others run
        # services.trainer.follower) and every learner is sharded over all of them
        self.ranks = Ranks.from_env()
        self._jobs_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._last_error: str | None = None
        self._foreign_jobs: set[str] = set()
        self._closed_jobs: set[str] = set()  # completed jobs this process let go of
        self._closed_checked_at = 0.0
        # base models under LoRA jobs' adapters, by base_key (not under torchrun)
        self.bases: dict[str, SharedBase] = {}

    @property
    def group(self) -> str:
        if self.settings.group:
            return self.settings.group
        return f"trainer.{self.settings.job_id}" if self.settings.job_id else "trainer"

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        assert self.runtime.db is not None and self.runtime.bus is not None and self.runtime.store is not None
        if self.ranks.sharded:
            self.device = await asyncio.to_thread(self.ranks.init, self.device)
        if self.settings.run_relay:
            self.relay = OutboxRelay(
                self.runtime.db,
                self.runtime.bus,
                keep_published_s=self.runtime.settings.db.outbox_keep_published_s,
            )
            self.runtime.spawn(self.relay.run(), "outbox-relay")
        await self.recover()
        self.runtime.checks["trainer"] = self._check
        self.consumer = await self.runtime.consume_handlers(handlers.topics(self), group=self.group)
        self.runtime.spawn(self._loop(), "trainer-loop")
        log_event(log, "trainer started", group=self.group, device=str(self.device), jobs=sorted(self.jobs),
                  ranks=self.ranks.world)  # fmt: skip

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        await asyncio.to_thread(self.ranks.stop)

    async def _check(self) -> None:
        failing = [j for j in self.jobs.values() if j.publish_error]
        if failing:
            raise RuntimeError(
                "; ".join(
                    f"cannot publish policy version v{j.learner.version + 1} of job {j.job_id} "
                    f"for {time.monotonic() - j.publish_failing_since:.0f}s: {j.publish_error}"
                    for j in failing
                )[:500]
            )
        if self._last_error:
            raise RuntimeError(self._last_error)

    async def recover(self) -> None:
        """Load every job that has buffered (received, untrained) trajectories."""
        assert self.runtime.db is not None
        query = (
            select(TrainedTrajectory.job_id)
            .where(TrainedTrajectory.step.is_(None), TrainedTrajectory.skipped.is_(None))
            .distinct()
        )
        if self.settings.job_id:
            query = query.where(TrainedTrajectory.job_id == self.settings.job_id)
        async with self.runtime.db.session() as s:
            job_ids = list((await s.execute(query)).scalars())
        for job_id in job_ids:
            try:
                await self.job(job_id)
            except Poison as exc:
                log_event(log, "cannot resume job", logging.ERROR, job_id=job_id, error=str(exc))
        if job_ids:
            self._wake.set()

    # --- receiving ----------------------------------------------------------------------

    async def handle(self, message: TrajectoryReady) -> None:
        """Buffer one trajectory durably (a ledger row) and wake the training loop.
        A redelivered message is a no-op."""
        if self.settings.job_id and message.job_id != self.settings.job_id:
            return
        if not message.job_id or not message.episode_id:
            raise Poison("trajectory.ready without job_id or episode_id")
        if message.job_id in self._closed_jobs:
            await self._record_after_end(message)
            return
        try:
            job = await self.job(message.job_id)
        except UnknownJob:
            # Topics can be shared by deployments (or test runs) with their own databases:
            # another one's trajectory is not ours to train on, nor a dead letter.
            if message.job_id not in self._foreign_jobs:
                self._foreign_jobs.add(message.job_id)
                log_event(log, "trajectories of an unknown job ignored", job_id=message.job_id)
            return
        assert self.runtime.db is not None and self.runtime.store is not None
        async with job.lock:
            if message.job_id in self._closed_jobs:  # closed while this waited for the lock
                await self._record_after_end(message)
                return
            if job.holds(message.episode_id):
                return
            async with self.runtime.db.session() as s:
                if await s.get(TrainedTrajectory, message.episode_id) is not None:
                    return  # already buffered, trained on or skipped
            raw = await self.runtime.store.get(
                message.trajectory_key
            )  # NotFound: retried, then dead-lettered
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
            if not await self._add_ledger_row(row):
                return  # a concurrent delivery of the same episode won
            self._add(job, Buffered(trajectory, message.trajectory_key, time.time()))
        self._wake.set()

    async def _record_after_end(self, message: TrajectoryReady) -> None:
        """A trajectory of a job already completed (a redelivery, or one scored after the
        job's last step): its ledger row says so, and nothing is loaded for it. An episode
        that already has a row keeps it."""
        await self._add_ledger_row(
            TrainedTrajectory(
                episode_id=message.episode_id,
                job_id=message.job_id,
                trajectory_key=message.trajectory_key,
                group_id=message.group_id,
                skipped=SKIP_JOB_ENDED,
            )
        )

    async def _add_ledger_row(self, row: TrainedTrajectory) -> bool:
        """Write one ledger row in its own transaction; False if the episode has one already."""
        assert self.runtime.db is not None
        try:
            async with self.runtime.db.session() as s:
                s.add(row)
        except IntegrityError:
            return False
        return True

    def _add(self, job: JobState, item: Buffered) -> None:
        group = job.groups.setdefault(item.trajectory.group_id, [])
        group.append(item)
        if len(group) >= job.spec.tasks.group_size:
            job.ready.append(job.groups.pop(item.trajectory.group_id))

    # --- jobs ---------------------------------------------------------------------------

    async def job(self, job_id: str) -> JobState:
        """The state of ``job_id``, loaded on first use: the initial policy, the latest
        checkpoint on top of it, and the buffered trajectories from the ledger."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        async with self._jobs_lock:
            if job_id not in self.jobs:
                self.jobs[job_id] = await self._load_job(job_id)
        return self.jobs[job_id]

    async def _load_job(self, job_id: str) -> JobState:
        db, store = self.runtime.db, self.runtime.store
        assert db is not None and store is not None
        async with db.session() as s:
            row = await s.get(Job, job_id)
            if row is None:
                raise UnknownJob(f"no job {job_id!r}")
            latest = await s.scalar(
                select(PolicyVersion)
                .where(PolicyVersion.job_id == job_id)
                .order_by(PolicyVersion.version.desc())
            )
            buffered = list(
                (
                    await s.execute(
                        select(TrainedTrajectory)
                        .where(
                            TrainedTrajectory.job_id == job_id,
                            TrainedTrajectory.step.is_(None),
                            TrainedTrajectory.skipped.is_(None),
                        )
                        .order_by(TrainedTrajectory.created_at, TrainedTrajectory.episode_id)
                    )
                ).scalars()
            )
        try:
            spec = JobSpec.model_validate(row.spec)
        except ValidationError as exc:
            raise Poison(f"job {job_id} has an invalid spec: {exc.errors()[0]['msg']}") from None
        checkpoint = None if latest is None else (latest.checkpoint_key, latest.step, latest.version)
        if self.ranks.sharded:
            async with self.ranks.turn(
                "load", {"job_id": job_id, "spec": row.spec, "checkpoint": checkpoint}
            ):
                learner = await build_learner(
                    spec, self.settings, store, self.device, checkpoint, ranks=self.ranks,
                    model_factory=self.model_factory,
                )  # fmt: skip
        else:
            learner = await build_learner(
                spec, self.settings, store, self.device, checkpoint, model_factory=self.model_factory,
                bases=self.bases,
            )  # fmt: skip
        init_job_metrics(job_id, learner.version)
        state = JobState(job_id=job_id, tenant_id=row.tenant_id, spec=spec, learner=learner)
        # a job is in self.jobs once loaded; count it with the others
        metrics.TRAINER_BASE_MODELS.set(self.base_models(also=learner))
        missing = []
        for r in buffered:
            try:
                trajectory = Trajectory.model_validate_json(await store.get(r.trajectory_key))
            except (NotFound, ValidationError):
                missing.append(r.episode_id)
                continue
            self._add(state, Buffered(trajectory, r.trajectory_key, r.created_at.timestamp()))
        if missing:
            await self._mark_skipped(state, missing, SKIP_MISSING)
        log_event(
            log,
            "job loaded",
            job_id=job_id,
            version=learner.version,
            step=learner.step_count,
            buffered=len(buffered) - len(missing),
            device=str(self.device),
        )
        return state

    # --- training -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.ranks.keepalive()
                await self.retry_publishes()
                await self.train_ready()
                if time.monotonic() - self._closed_checked_at >= self.CLOSE_CHECK_S:
                    self._closed_checked_at = time.monotonic()
                    await self.close_completed_jobs()
                self._last_error = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the service up; /health reports it
                self._last_error = f"training failed: {exc!r}"[:300]
                log.exception("training pass failed")
                await asyncio.sleep(2)

    async def train_ready(self, job_id: str | None = None) -> list[StepStats]:
        """Run every step the buffers allow (all jobs, or one); returns their statistics."""
        out: list[StepStats] = []
        for job in [self.jobs[job_id]] if job_id else list(self.jobs.values()):
            with log_context(job_id=job.job_id):
                while (stats := await self._train_one(job)) is not None:
                    out.append(stats)
        return out

    async def _train_one(self, job: JobState) -> StepStats | None:
        async with job.train_lock:
            return await self._train_one_locked(job)

    async def _train_one_locked(self, job: JobState) -> StepStats | None:
        per_step = job.spec.algorithm.groups_per_step
        async with job.lock:
            await self._sweep(job)
            if len(job.ready) < per_step:
                return None
            batch, job.ready = job.ready[:per_step], job.ready[per_step:]
        groups = [[b.trajectory for b in g] for g in batch]
        episodes = [b.episode_id for g in batch for b in g]
        try:
            if self.ranks.sharded:
                args = {"job_id": job.job_id, "groups": groups, "version": job.learner.version}
                async with self.ranks.turn("step", args):
                    stats = await asyncio.to_thread(job.learner.step, groups)
            else:
                stats = await asyncio.to_thread(job.learner.step, groups)
        except Exception as exc:  # noqa: BLE001 - any failure of this batch
            if self.ranks.sharded:
                # the ranks may have parted mid-step (one rank's share failed): start them again
                self.ranks.abort(exc)
            # A batch that cannot be trained on must not stall the job: skip it, say why.
            log.exception("training step failed; its groups are skipped")
            await self._mark_skipped(job, episodes, SKIP_TRAIN_ERROR, groups=len(batch))
            log_event(log, "step skipped", logging.ERROR, job_id=job.job_id, error=repr(exc)[:300])
            return None
        job.seconds_since_checkpoint += stats.seconds  # a step that learned nothing took time too
        if not stats.updated:
            await self._mark_skipped(job, episodes, SKIP_NO_UPDATE, groups=len(batch))
            return stats
        job.uncheckpointed.update(dict.fromkeys(episodes, stats.step))
        job.steps_since_checkpoint += 1
        job.history.append(stats.as_dict())
        self._observe(job, stats)
        if job.steps_since_checkpoint >= job.spec.algorithm.checkpoint_every:
            await self._publish(job, stats)
        if self.on_step is not None:
            self.on_step(job.job_id, stats)
        return stats

    # --- publishing, retried ------------------------------------------------------------

    PUBLISH_BACKOFF_MAX_S = 30.0

    async def _publish(self, job: JobState, stats: StepStats | None) -> int | None:
        """:meth:`checkpoint`, called with ``train_lock`` held. A failure (the object store or
        the database unreachable) keeps the trained steps in memory and is retried by the
        loop with backoff (:meth:`retry_publishes`); meanwhile /health answers 503 and the
        job carries a ``stuck: ...`` reason."""
        try:
            version = await self.checkpoint(job, stats)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried with backoff; /health reports it
            await self._publish_failed(job, exc)
            return None
        if job.publish_error is not None:
            await self._publish_recovered(job, version)
        return version

    async def retry_publishes(self) -> None:
        """Retry every failed publish whose backoff has passed (the trainer's loop calls this:
        a publish must not wait for a new step, which may never come)."""
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.publish_error is None or now < job.next_publish_at:
                continue
            async with job.train_lock:
                if job.publish_error is None:
                    continue
                if not job.steps_since_checkpoint:  # published meanwhile (e.g. flush)
                    await self._publish_recovered(job, job.learner.version)
                    continue
                last = job.history[-1] if job.history else None
                with log_context(job_id=job.job_id):
                    await self._publish(job, StepStats(**last) if last else None)

    async def _publish_failed(self, job: JobState, exc: BaseException) -> None:
        now = time.monotonic()
        if job.publish_error is None:
            job.publish_failing_since = now
        job.publish_failures += 1
        job.publish_error = repr(exc)[:300]
        job.next_publish_at = now + min(self.PUBLISH_BACKOFF_MAX_S, 2.0 ** min(job.publish_failures - 1, 10))
        metrics.TRAINER_PUBLISH_FAILING.labels(job.job_id).set(1)
        metrics.TRAINER_PUBLISH_FAILURES.labels(job.job_id).inc()
        dependency = unavailable_dependency(exc)
        if dependency is not None:
            dependency_failed(log, dependency, exc, job_id=job.job_id, waiting="publishing a policy version")
        else:
            log_event(log, "policy version not published; retrying", logging.ERROR, job_id=job.job_id,
                      attempt=job.publish_failures, error=job.publish_error)  # fmt: skip
        why = f"trainer cannot publish policy version v{job.learner.version + 1}: {job.publish_error}"
        await self._set_stuck_reason(job.job_id, why)

    async def _publish_recovered(self, job: JobState, version: int) -> None:
        stuck_s = time.monotonic() - job.publish_failing_since
        log_event(log, "policy version published after failures", job_id=job.job_id, version=version,
                  failures=job.publish_failures, stuck_s=round(stuck_s, 1))  # fmt: skip
        job.publish_error, job.publish_failures, job.next_publish_at = None, 0, 0.0
        metrics.TRAINER_PUBLISH_FAILING.labels(job.job_id).set(0)
        for dependency in (OBJECT_STORE, DATABASE, NETWORK):
            dependency_recovered(log, dependency)
        await self._set_stuck_reason(job.job_id, None)

    async def _set_stuck_reason(self, job_id: str, why: str | None) -> None:
        """Show (or clear) why the job does not move (:func:`temper.lifecycle.mark_job_stuck`)."""
        assert self.runtime.db is not None
        try:
            async with self.runtime.db.session() as s:
                await mark_job_stuck(s, job_id, why)
        except Exception as exc:  # noqa: BLE001 - the database may be what is down; /health says so
            log_event(log, "cannot record the job's stuck reason", logging.WARNING, job_id=job_id,
                      error=repr(exc)[:200])  # fmt: skip

    async def _sweep(self, job: JobState) -> None:
        """Drop what cannot be trained on (called with the job's lock held): ready groups
        with zero reward variance or older than ``max_staleness`` versions, and groups
        still incomplete after ``group_timeout_s`` (trained as they are from 2 samples)."""
        now = time.time()
        for gid, items in list(job.groups.items()):
            if now - min(b.arrived for b in items) >= self.settings.group_timeout_s:
                del job.groups[gid]
                if len(items) >= 2:
                    job.ready.append(items)
                else:
                    await self._mark_skipped(job, [b.episode_id for b in items], SKIP_INCOMPLETE, groups=1)
        keep = []
        for items in job.ready:
            reason = None
            if job.spec.algorithm.skip_zero_variance and is_zero_variance(
                [b.trajectory.reward for b in items]
            ):
                reason = SKIP_ZERO_VARIANCE
            elif max(job.learner.version - b.trajectory.behaviour_version for b in items) > (
                job.spec.schedule.max_staleness
            ):
                reason = SKIP_STALE
            if reason is None:
                keep.append(items)
            else:
                await self._mark_skipped(job, [b.episode_id for b in items], reason, groups=1)
        job.ready = keep

    async def _mark_skipped(
        self, job: JobState, episodes: list[str], reason: str, *, groups: int = 0
    ) -> None:
        assert self.runtime.db is not None
        async with self.runtime.db.session() as s:
            await s.execute(
                update(TrainedTrajectory)
                .where(TrainedTrajectory.episode_id.in_(episodes))
                .values(skipped=reason)
            )
        if groups:
            job.skipped[reason] = job.skipped.get(reason, 0) + groups
            metrics.TRAINER_SKIPPED_GROUPS.labels(job.job_id).inc(groups)
        log_event(log, "trajectories skipped", job_id=job.job_id, reason=reason, episodes=len(episodes))

    # --- the end of a job ---------------------------------------------------------------

    CLOSE_CHECK_S = 5.0  # how often the loop looks for jobs the dispatcher completed

    async def close_completed_jobs(self) -> list[str]:
        """Let go of the loaded jobs the dispatcher has completed; returns their ids.

        The dispatcher completes a job once the trainer has read every scored episode and
        holds fewer than ``groups_per_step`` untrained groups, so what such a job still
        buffers can never make a step: it is marked ``skipped: job_ended`` (the ledger then
        accounts for every trajectory), steps not yet checkpointed are published, and the
        learner's memory goes back (with its adapter's share of a shared base). Failed and
        cancelled jobs stay loaded: they can be resumed."""
        if not self.jobs:
            return []
        assert self.runtime.db is not None
        async with self.runtime.db.session() as s:
            ended = list(
                (
                    await s.execute(
                        select(Job.id).where(Job.id.in_(list(self.jobs)), Job.state == "completed")
                    )
                ).scalars()
            )
        for job_id in ended:
            await self.flush(job_id)
            job = self.jobs[job_id]
            async with job.train_lock, job.lock:
                left = [b.episode_id for g in (*job.groups.values(), *job.ready) for b in g]
                if left:
                    groups = len(job.groups) + len(job.ready)
                    await self._mark_skipped(job, left, SKIP_JOB_ENDED, groups=groups)
                job.groups.clear()
                job.ready.clear()
                del self.jobs[job_id]
                self._closed_jobs.add(job_id)
                _release(job.learner, self.bases)
                if self.ranks.sharded:
                    async with self.ranks.turn("unload", {"job_id": job_id}):
                        pass
            log_event(log, "job closed", job_id=job_id, skipped=len(left), version=job.learner.version)
        return ended

    def _observe(self, job: JobState, stats: StepStats) -> None:
        observe_step(job.job_id, stats)
        log_event(log, "trainer step", **stats.as_dict())

    async def checkpoint(self, job: JobState, stats: StepStats | None = None) -> int:
        """Publish the learner's weights as the next policy version: the files first, then
        one transaction with the version row, the ledger, the job and the outbox message."""
        db, store = self.runtime.db, self.runtime.store
        assert db is not None and store is not None
        learner = job.learner
        version = learner.version + 1
        prefix = registry.version_prefix(job.tenant_id, job.job_id, version)
        base_model = job.spec.policy.init or job.spec.policy.model
        tokenizer = await asyncio.to_thread(_tokenizer, job.spec)
        if self.ranks.sharded:
            # every rank writes its shard of the state; rank 0 the served weights and manifest
            args = {"job_id": job.job_id, "prefix": prefix, "version": version, "base_model": base_model}
            async with self.ranks.turn("publish", args):
                key = await learner.publish_version(
                    store,
                    prefix,
                    job_id=job.job_id,
                    version=version,
                    base_model=base_model,
                    tokenizer=tokenizer,
                )
        else:
            key = await learner.publish_version(
                store, prefix, job_id=job.job_id, version=version, base_model=base_model, tokenizer=tokenizer
            )
        summary = stats.as_dict() if stats is not None else {}
        by_step: dict[int, list[str]] = {}
        for episode, step in job.uncheckpointed.items():
            by_step.setdefault(step, []).append(episode)
        async with db.session() as s:
            s.add(
                PolicyVersion(
                    job_id=job.job_id,
                    version=version,
                    checkpoint_key=key,
                    step=learner.step_count,
                    metrics=summary,
                    train_s=round(job.seconds_since_checkpoint, 6),
                )
            )
            for step, episodes in by_step.items():
                await s.execute(
                    update(TrainedTrajectory)
                    .where(TrainedTrajectory.episode_id.in_(episodes))
                    .values(step=step)
                )
            await s.execute(
                update(Job)
                .where(Job.id == job.job_id, Job.policy_version < version)
                .values(policy_version=version)
            )
            enqueue(
                s,
                Topics.POLICY_UPDATES,
                PolicyUpdate(job_id=job.job_id, version=version, checkpoint_key=key, step=learner.step_count),
            )
            enqueue(
                s,
                Topics.EVENTS,
                LifecycleEvent(
                    event="policy.version",
                    job_id=job.job_id,
                    tenant=job.tenant_id,
                    version=version,
                    data=summary,
                ),
            )
        learner.version = version
        job.uncheckpointed.clear()
        job.steps_since_checkpoint = 0
        job.seconds_since_checkpoint = 0.0
        metrics.POLICY_VERSION.labels(job.job_id).set(version)
        if self.relay is not None:
            self.relay.notify()
        log_event(
            log,
            "policy version published",
            job_id=job.job_id,
            version=version,
            step=learner.step_count,
            checkpoint_key=key,
        )
        return version

    async def flush(self, job_id: str) -> int | None:
        """Publish the steps trained since the last checkpoint as a version now (the end of
        a job whose step count is not a multiple of ``checkpoint_every``); returns the
        version, or None if there was nothing to publish."""
        job = self.jobs.get(job_id)
        if job is None or not job.steps_since_checkpoint:
            return None
        async with job.train_lock:
            if not job.steps_since_checkpoint:
                return None
            last = job.history[-1] if job.history else None
            version = await self.checkpoint(job, StepStats(**last) if last else None)
            if job.publish_error is not None:
                await self._publish_recovered(job, version)
            return version

    def base_models(self, *, also: Learner | None = None) -> int:
        """Copies of a base model this process holds: one per shared base, one per job
        that has its own (full-weights jobs, LoRA jobs under torchrun); ``also``: a
        learner not yet in ``jobs``."""
        learners = [j.learner for j in self.jobs.values()] + ([also] if also is not None else [])
        own = {id(lr.model) for lr in learners if lr.shared is None}
        return len(self.bases) + len(own)

    def status(self) -> dict[str, Any]:
        """What ``GET /v1/status`` shows."""
        return {
            "group": self.group,
            "device": str(self.device),
            "ranks": self.ranks.world,
            "last_error": self._last_error,
            "base_models": self.base_models(),
            "shared_bases": {
                key: sorted(jid for jid, j in self.jobs.items() if j.learner.shared is base)
                for key, base in self.bases.items()
            },
            "jobs": {
                jid: {
                    "policy_version": j.learner.version,
                    "shared_base": j.learner.shared.key if j.learner.shared is not None else None,
                    "step": j.learner.step_count,
                    "buffered_trajectories": j.buffered,
                    "ready_groups": len(j.ready),
                    "uncheckpointed_steps": j.steps_since_checkpoint,
                    "publish_error": j.publish_error,
                    "publish_failures": j.publish_failures,
                    "skipped_groups": dict(j.skipped),
                    "last_step": j.history[-1] if j.history else None,
                }
                for jid, j in self.jobs.items()
            },
        }


def _tokenizer(spec: JobSpec) -> ChatTokenizer:
    """The tokenizer a full version is published with: the initial model directory's, else
    the byte tokenizer of the CPU presets."""
    init = spec.policy.init or spec.policy.model
    if Path(init).is_dir() and (Path(init) / "tokenizer.json").is_file():
        return ChatTokenizer.load(init)
    return default_tokenizer()


def _load_local(init: str) -> torch.nn.Module | None:
    """A local model directory, if ``init`` names one."""
    if not Path(init).is_dir():
        return None
    return load_causal_lm(init)


def _load_files(files: dict[str, bytes], preset: str, seed: int) -> torch.nn.Module:
    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        if "config.json" in files:
            return load_causal_lm(d)
        model = create_model(preset, seed=seed)
        load_weights(model, Path(d) / "model.safetensors")
        return model


async def initial_model(
    spec: JobSpec, settings: TrainerSettings, store: ObjectStore, model_factory: ModelFactory | None = None
) -> torch.nn.Module:
    """A job's initial policy: ``model_factory``'s, else ``policy.init`` (a local model
    directory or an object-store key), else ``policy.model`` when it is a model
    directory, else the ``TEMPER_TRAINER__PRESET`` preset."""
    if model_factory is not None:
        return await asyncio.to_thread(model_factory, spec)
    # no initial weights named: the model the gateway serves, when policy.model is a directory
    init = spec.policy.init or (spec.policy.model if is_model_dir(spec.policy.model) else None)
    if not init:
        return await asyncio.to_thread(create_model, settings.preset, seed=settings.seed)
    local = await asyncio.to_thread(_load_local, init)
    if local is not None:
        return local
    # an object-store key: a model directory prefix (config.json + model.safetensors)
    # or a .safetensors file of the configured preset
    files: dict[str, bytes] = {}
    if init.endswith(".safetensors"):
        files["model.safetensors"] = await store.get(init)
    else:
        base = init.rstrip("/") + "/"
        for key in await store.list(base):
            if "/" not in key[len(base) :]:
                files[key[len(base) :]] = await store.get(key)
    return await asyncio.to_thread(_load_files, files, settings.preset, settings.seed)


def base_key(spec: JobSpec, config: LearnerConfig) -> str:
    """What makes two LoRA jobs' base models the same one in memory: the initial weights'
    name (as :func:`initial_model` resolves it) and gradient checkpointing, a switch on
    the model itself. The weights are float32 in every learner (bf16 is autocast)."""
    name = spec.policy.init or spec.policy.model
    return f"{name} (gradient checkpointing)" if config.gradient_checkpointing else name


async def build_learner(
    spec: JobSpec,
    settings: TrainerSettings,
    store: ObjectStore,
    device: torch.device,
    checkpoint: tuple[str, int, int] | None,
    *,
    ranks: Ranks | None = None,
    model_factory: ModelFactory | None = None,
    bases: dict[str, SharedBase] | None = None,
) -> Learner:
    """A job's learner: the initial policy (which stays the KL reference, also after a
    restart), with the latest version ``(checkpoint key, step, version)`` restored on top.
    With several ``ranks`` the model is sharded over them (every rank calls this, in step):
    a version with sharded state is loaded after sharding, whatever number of ranks wrote
    it; an older one (full weights, one process's) before. With ``bases`` (one process),
    a LoRA job's adapter goes on the shared base model of its :func:`base_key`, loaded
    the first time and added to ``bases``."""
    sharded = ranks is not None and ranks.sharded
    key = checkpoint[0] if checkpoint else None
    error: Exception | None = None
    try:
        config = LearnerConfig.from_spec(spec.algorithm, settings)
        if bases is not None and config.lora is not None and not sharded:
            name = base_key(spec, config)
            shared = bases.get(name)
            if shared is None:
                shared = SharedBase(await initial_model(spec, settings, store, model_factory), key=name)
            learner = await asyncio.to_thread(Learner, shared, config, device=device)
            bases[name] = shared  # once it holds an adapter
        else:
            model = await initial_model(spec, settings, store, model_factory)
            learner = await asyncio.to_thread(Learner, model, config, device=device)
        has_state = (
            sharded and key is not None and registry.is_manifest_key(key) and await _has_state(store, key)
        )
    except Exception as exc:
        if not sharded:
            raise
        error = exc
    if sharded:
        # the ranks go on to sharding (collectives) together, or all fail here
        await asyncio.to_thread(agree, error)
    if sharded and has_state:
        await asyncio.to_thread(shard, learner)
    if key is not None:
        try:
            if registry.is_manifest_key(key):
                await learner.load_version(store, key)
            else:  # a checkpoint written before the registry: two safetensors files
                await learner.load_checkpoint(store, key)
        except Exception:
            _release(learner, bases)
            raise
    if sharded and not has_state:
        await asyncio.to_thread(shard, learner)
    if checkpoint is not None:
        learner.step_count, learner.version = checkpoint[1], checkpoint[2]
    return learner


def _release(learner: Learner, bases: dict[str, SharedBase] | None) -> None:
    """Take back the adapter of a job that failed to load or was closed (and the base, if
    it was the only job on it)."""
    shared = learner.shared
    if shared is None or bases is None:
        return
    if shared.adapters == [learner.adapter]:
        bases.pop(shared.key, None)
    else:
        shared.remove(learner.adapter)


async def _has_state(store: ObjectStore, key: str) -> bool:
    manifest = await registry.read_manifest(store, key)
    return any(n.startswith(f"{registry.TRAINER_DIR}/{DCP_DIR}/") for n in manifest.files)
