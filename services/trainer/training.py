"""The trainer's work: trajectories in, policy versions out, for every job this process
owns (the component, :mod:`services.trainer.component`, starts and stops it).

Trajectories are gathered into groups (same task, ``tasks.group_size`` samples) in each
job's buffer (:class:`services.trainer.buffer.TrainingJob`), durably recorded in the
ledger first (:mod:`services.trainer.ledger`). Whenever ``algorithm.groups_per_step``
groups are ready, the job's learner makes one GRPO step (:class:`temper.training.Learner`);
every ``algorithm.checkpoint_every`` steps the steps are published as the next policy
version (:mod:`services.trainer.publishing`).

What makes a crash safe:

- a trajectory is in the ledger before its offset is committed, and a redelivered message
  whose episode already has a row is ignored;
- a row gets its ``step`` only in the transaction that publishes the version holding that
  step's update; a crash between a step and its publish loses the update and the ledger
  still says "buffered", so the trajectory is trained on again, once, from the restored
  version;
- a group not trained on gets ``skipped`` = the reason, in its own transaction;
- what a job still buffers when the dispatcher completes it (too few groups for a step,
  say after a stale group was dropped) gets ``skipped: job_ended``, and the job's learner
  is let go (:meth:`JobTrainer.close_completed_jobs`).

One trainer owns a job: run one trainer process for all jobs (consumer group
``trainer``), or one per job with ``TEMPER_TRAINER__JOB_ID`` (group ``trainer.<job>``).
Two trainers on one job would each hold part of its groups.

LoRA jobs on the same base model share one copy of it in the trainer process
(:class:`temper.training.lora.SharedBase`, keyed by
:func:`services.trainer.learners.base_key`): each job holds its adapter and that
adapter's AdamW state, and the jobs step in turn.

Under ``torchrun`` this runs on rank 0 only; every learner operation with collectives
(load, step, publish) is opened with a command to the other ranks
(:mod:`services.trainer.ranks`, :mod:`services.trainer.follower`), and the model is
sharded over all of them (:func:`services.trainer.learners.build_learner`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError
from sqlalchemy import select

from services.trainer import ledger, publishing
from services.trainer.buffer import Buffered, TrainingJob
from services.trainer.learners import ModelFactory, build_learner, release
from services.trainer.ledger import (
    SKIP_JOB_ENDED,
    SKIP_MISMATCH,
    SKIP_MISSING,
    SKIP_NO_UPDATE,
    SKIP_TRAIN_ERROR,
)
from services.trainer.mismatch import record_canary
from services.trainer.observe import init_job_metrics, observe_step
from services.trainer.ranks import Ranks
from services.trainer.receipts import Receipts, UnknownJob
from services.trainer.supervised_jobs import SupervisedJobs
from temper import cores, faults, metrics
from temper.bus import Poison
from temper.db import Database, Job, PolicyVersion
from temper.events import TrajectoryReady
from temper.jobspec import JobSpec
from temper.lifecycle import JobState
from temper.logs import log_context, log_event
from temper.settings.trainer import TrainerSettings
from temper.storage import NotFound, ObjectStore
from temper.training import Learner, StepStats, pick_device
from temper.training.lora import SharedBase
from temper.trajectory import Trajectory

log = logging.getLogger("temper.trainer")


class JobTrainer(SupervisedJobs):
    """Trains every job this process owns (see the module docstring). ``model_factory``
    builds a job's initial policy; by default it comes from ``policy.init`` (a local model
    directory or an object-store key) or the ``TEMPER_TRAINER__PRESET`` preset.
    ``notify_outbox`` is called after each published version (the outbox relay sends its
    messages at once)."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        settings: TrainerSettings,
        *,
        ranks: Ranks,
        model_factory: ModelFactory | None = None,
        on_step: Callable[[str, StepStats], None] | None = None,
        notify_outbox: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self.store = store
        self.settings = settings
        self.ranks = ranks
        self.model_factory = model_factory
        self.on_step = on_step
        self.notify_outbox = notify_outbox
        self.jobs: dict[str, TrainingJob] = {}
        self.device = pick_device(settings.device)
        self._jobs_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._last_error: str | None = None
        self._foreign_jobs: set[str] = set()
        self._closed_jobs: set[str] = set()  # completed jobs this process let go of
        self._closed_checked_at = 0.0
        # base models under LoRA jobs' adapters, by base_key (not under torchrun)
        self.bases: dict[str, SharedBase] = {}
        SupervisedJobs.__init__(self)
        self.receipts = Receipts(
            db, store, settings, jobs=self.jobs, closed_jobs=self._closed_jobs,
            foreign_jobs=self._foreign_jobs, load_job=self.job, wake=self._wake,
        )  # fmt: skip

    @property
    def group(self) -> str:
        if self.settings.group:
            return self.settings.group
        return f"trainer.{self.settings.job_id}" if self.settings.job_id else "trainer"

    async def start_ranks(self) -> None:
        """Join torchrun's other ranks (when there are several); the device is this rank's."""
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        if self.ranks.sharded:
            self.device = await asyncio.to_thread(self.ranks.init, self.device)

    async def check(self) -> None:
        """Raise while a publish fails or the last training pass failed (``/health``)."""
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
        job_ids = await ledger.jobs_with_buffered(self.db, self.settings.job_id)
        for job_id in job_ids:
            try:
                await self.job(job_id)
            except Poison as exc:
                log_event(log, "cannot resume job", logging.ERROR, job_id=job_id, error=str(exc))
        if job_ids:
            self._wake.set()

    # --- receiving ----------------------------------------------------------------------

    async def receive(self, message: TrajectoryReady) -> None:
        """Buffer one trajectory durably (a ledger row) and wake the training loop; several
        handed over at once share a transaction (:mod:`services.trainer.receipts`). A
        redelivered message is a no-op."""
        await self.receipts.receive(message)

    # --- jobs ---------------------------------------------------------------------------

    async def job(self, job_id: str) -> TrainingJob:
        """The state of ``job_id``, loaded on first use: the initial policy, the latest
        checkpoint on top of it, and the buffered trajectories from the ledger."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        async with self._jobs_lock:
            if job_id not in self.jobs:
                self.jobs[job_id] = await self._load_job(job_id)
        return self.jobs[job_id]

    async def _load_job(self, job_id: str) -> TrainingJob:
        db, store = self.db, self.store
        async with db.session() as s:
            row = await s.get(Job, job_id)
            if row is None:
                raise UnknownJob(f"no job {job_id!r}")
            latest = await s.scalar(
                select(PolicyVersion)
                .where(PolicyVersion.job_id == job_id)
                .order_by(PolicyVersion.version.desc())
            )
            buffered = await ledger.buffered_rows(s, job_id)
        try:
            spec = JobSpec.model_validate(row.spec)
        except ValidationError as exc:
            raise Poison(f"job {job_id} has an invalid spec: {exc.errors()[0]['msg']}") from None
        checkpoint = None if latest is None else (latest.checkpoint_key, latest.step, latest.version)
        from temper.policy.tokenizer import fetch_policy_tokenizer

        # what its versions are published with, when its initial model is in object storage
        await fetch_policy_tokenizer(store, spec.policy.init, None, self._tokenizer_cache)
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
        state = TrainingJob(job_id=job_id, tenant_id=row.tenant_id, spec=spec, learner=learner)
        # a job is in self.jobs once loaded; count it with the others
        metrics.TRAINER_BASE_MODELS.set(self.base_models(also=learner))
        missing = []
        for r in buffered:
            try:
                trajectory = Trajectory.model_validate_json(await store.get(r.trajectory_key))
            except (NotFound, ValidationError):
                missing.append(r.episode_id)
                continue
            state.add(Buffered(trajectory, r.trajectory_key, r.created_at.timestamp()))
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

    async def run(self) -> None:
        """The training loop: woken by each buffered trajectory, and every second to retry
        publishes, keep torchrun's ranks alive and let go of completed jobs."""
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
                if await self.train_sft():
                    self._wake.set()  # more sft steps to make: the next pass comes at once
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

    async def _train_one(self, job: TrainingJob) -> StepStats | None:
        async with job.train_lock:
            return await self._train_one_locked(job)

    async def _train_one_locked(self, job: TrainingJob) -> StepStats | None:
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
                stats = await asyncio.to_thread(cores.run_busy, "trainer", job.learner.step, groups)
        except Exception as exc:  # noqa: BLE001 - any failure of this batch
            if self.ranks.sharded:
                # the ranks may have parted mid-step (one rank's share failed): start them again
                self.ranks.abort(exc)
            # A batch that cannot be trained on must not stall the job: skip it, say why.
            log.exception("training step failed; its groups are skipped")
            await self._mark_skipped(job, episodes, SKIP_TRAIN_ERROR, groups=len(batch))
            log_event(log, "step skipped", logging.ERROR, job_id=job.job_id, error=repr(exc)[:300])
            return None
        await faults.hold("trainer.step", work=len(episodes), job_id=job.job_id, step=stats.step)
        job.seconds_since_checkpoint += stats.seconds  # a step that learned nothing took time too
        await record_canary(self.db, job, stats)
        if stats.refused:
            await self._mark_skipped(job, episodes, SKIP_MISMATCH, groups=len(batch))
            return stats
        if not stats.updated:
            await self._mark_skipped(job, episodes, SKIP_NO_UPDATE, groups=len(batch))
            return stats
        job.flat_since_step = 0
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

    async def _publish(self, job: TrainingJob, stats: StepStats | None) -> int | None:
        """:meth:`checkpoint`, called with ``train_lock`` held. A failure (the object store or
        the database unreachable) keeps the trained steps in memory and is retried by the
        loop with backoff (:meth:`retry_publishes`); meanwhile /health answers 503 and the
        job carries a ``stuck: ...`` reason."""
        try:
            version = await self.checkpoint(job, stats)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried with backoff; /health reports it
            await publishing.publish_failed(self.db, job, exc)
            return None
        if job.publish_error is not None:
            await publishing.publish_recovered(self.db, job, version)
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
                    await publishing.publish_recovered(self.db, job, job.learner.version)
                    continue
                last = job.history[-1] if job.history else None
                with log_context(job_id=job.job_id):
                    await self._publish(job, StepStats(**last) if last else None)

    CLOSED_CHECK_S = 1.0  # how often a job's incomplete groups are looked up in the database
    STALLED_STEPS = 2  # zero-variance groups worth this many steps in a row, none trained: warn

    async def _sweep(self, job: TrainingJob) -> None:
        """Drop what cannot be trained on (called with the job's lock held; see
        :meth:`TrainingJob.sweep`) and record why in the ledger. Incomplete groups whose
        other episodes ended without a trajectory (failed, or cancelled with their job) are
        closed now rather than after ``group_timeout_s``: a resumed job trains what it holds
        at once."""
        closed: set[str] = set()
        if job.groups and time.monotonic() - job.closed_checked_at >= self.CLOSED_CHECK_S:
            job.closed_checked_at = time.monotonic()
            closed = await ledger.closed_groups(self.db, job.job_id, list(job.groups))
        flat = job.flat_since_step
        for items, reason in job.sweep(time.time(), self.settings.group_timeout_s, closed):
            await self._mark_skipped(job, [b.episode_id for b in items], reason, groups=1)
        stalled = self.STALLED_STEPS * job.spec.algorithm.groups_per_step
        if flat < stalled <= job.flat_since_step:
            # said once per stall: the job goes on sampling, but nothing will train it
            log_event(log, "no step: every group since the last one had zero reward variance",
                      logging.WARNING, job_id=job.job_id, groups=job.flat_since_step,
                      version=job.learner.version)  # fmt: skip

    async def _mark_skipped(
        self, job: TrainingJob, episodes: list[str], reason: str, *, groups: int = 0
    ) -> None:
        await ledger.mark_skipped(self.db, episodes, reason)
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
        async with self.db.session() as s:
            ended = list(
                (
                    await s.execute(
                        select(Job.id).where(Job.id.in_(list(self.jobs)), Job.state == JobState.completed)
                    )
                ).scalars()
            )
        for job_id in ended:
            await self.flush(job_id)
            job = self.jobs[job_id]
            async with job.train_lock, job.lock:
                left = job.episodes()
                if left:
                    groups = len(job.groups) + len(job.ready)
                    await self._mark_skipped(job, left, SKIP_JOB_ENDED, groups=groups)
                job.groups.clear()
                job.ready.clear()
                del self.jobs[job_id]
                self._closed_jobs.add(job_id)
                release(job.learner, self.bases)
                if self.ranks.sharded:
                    async with self.ranks.turn("unload", {"job_id": job_id}):
                        pass
            log_event(log, "job closed", job_id=job_id, skipped=len(left), version=job.learner.version)
        return ended

    def _observe(self, job: TrainingJob, stats: StepStats) -> None:
        observe_step(job.job_id, stats)
        log_event(log, "trainer step", **stats.as_dict())

    async def checkpoint(self, job: TrainingJob, stats: StepStats | None = None) -> int:
        """Publish the learner's weights as the next policy version
        (:func:`services.trainer.publishing.publish`); returns the version."""
        version, key = await publishing.publish(
            job, db=self.db, store=self.store, ranks=self.ranks, stats=stats
        )
        metrics.POLICY_VERSION.labels(job.job_id).set(version)
        if self.notify_outbox is not None:
            self.notify_outbox()
        log_event(log, "policy version published", job_id=job.job_id, version=version,
                  step=job.learner.step_count, checkpoint_key=key)  # fmt: skip
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
                await publishing.publish_recovered(self.db, job, version)
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
            "jobs": {jid: j.status() for jid, j in self.jobs.items()},
        }
