"""The job scheduler: picks up pending jobs, starts episodes in groups, advances
iterations under the staleness bound, and completes jobs.

Everything it decides comes from the database (counts of episodes per iteration and
state, the trainer's ledger, the job's policy version), so a replica that takes over a
job after a crash continues exactly where the last leader stopped.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import timedelta

from pydantic import ValidationError
from sqlalchemy import and_, func, or_, select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher import evaluation, repo, staleness
from services.dispatcher.episodes import ACTIVE, EpisodeMachine, new_id
from services.dispatcher.fairshare import QUOTA_REASON, FleetShare, has_quota, quota_exceeded, tenant_usage
from services.dispatcher.leader import Leadership
from services.dispatcher.placement import backend_wait
from services.dispatcher.sampling import replacement_groups, replacements_due, zero_variance_groups
from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Job, PolicyVersion, Task, Tenant, rows
from temper.events import PolicyUpdate, Topics, TrajectoryReady
from temper.jobspec import Curriculum, JobSpec
from temper.lifecycle import (
    STUCK_PREFIX,
    EpisodeState,
    JobState,
    mark_job_stuck,
    transition_episode,
    transition_job,
)
from temper.logs import log_context, log_event
from temper.outbox import enqueue
from temper.tasks.service import outcome_totals, sampleable

log = logging.getLogger("temper.dispatcher.scheduler")

E, J = EpisodeState, JobState
DEFAULT_TENANT_QUOTA = 64
WAITING_FOR_ROOM = "waiting for room: "
# Episodes one pass starts at most: a pass is one transaction on the event loop, and
# starting 20,000 at once held it for 40 s (the consumers' Kafka sessions expired) and sent
# 40,000 commands in one burst; the next pass follows at once.
MAX_STARTS_PER_PASS = 256
# Curriculum weights: tasks with an unknown or strictly-between pass rate are preferred.
LEARNABLE_WEIGHT, SETTLED_WEIGHT = 1.0, 0.05


def task_weight(attempts: int, passes: int, curriculum: Curriculum) -> float:
    if curriculum is Curriculum.uniform or attempts == 0:
        return LEARNABLE_WEIGHT
    rate = passes / attempts
    return LEARNABLE_WEIGHT if 0.0 < rate < 1.0 else SETTLED_WEIGHT


def init_job_metrics(job_id: str) -> None:
    """A started job's gauges read 0 until its first tick sets them, so its panels show
    the job from its start."""
    metrics.EPISODES_ACTIVE.labels(job_id).set(0)
    metrics.JOB_ITERATION.labels(job_id).set(0)


@dataclass(frozen=True)
class Candidate:
    task_id: str
    weight: float


class Scheduler:
    def __init__(
        self,
        machine: EpisodeMachine,
        leadership: Leadership,
        *,
        trainer_attached: bool,
        wait_for_training: bool,
        fleet_max_episodes: int | None = None,
    ) -> None:
        self.machine = machine
        self.leadership = leadership
        self.trainer_attached = trainer_attached
        self.wait_for_training = trainer_attached and wait_for_training
        self.fleet = FleetShare(fleet_max_episodes)

    async def tick(self) -> None:
        async with self.machine.db.session() as session:
            live = or_(
                Job.state.in_([J.pending, J.running]),
                and_(Job.state == J.paused, Job.state_reason.startswith(QUOTA_REASON)),
            )
            jobs = list(
                # oldest first: jobs waiting for a backend get it in the order they came
                await session.execute(
                    select(Job.id, Job.tenant_id, Job.state).where(live).order_by(Job.created_at, Job.id)
                )
            )
            # the fleet's room is planned for the tenants that may start episodes now
            await self.fleet.begin_tick(session, {t for _, t, state in jobs if state != J.paused})
        # the neediest tenant's jobs first; ties in a new order each tick, so no tenant's
        # episodes are always the first sent on
        jobs.sort(key=lambda row: (self.fleet.need(row[1]), random.random()))
        job_ids = [job_id for job_id, _, _ in jobs]
        for job_id in job_ids:
            if await self.leadership.acquire(job_id):
                with log_context(job_id=job_id):
                    await self.schedule_isolated(job_id)
        for job_id in self.leadership.held - set(job_ids):
            await self.leadership.release(job_id)

    # --- one job -------------------------------------------------------------------------------
    async def schedule_isolated(self, job_id: str) -> None:
        """Schedule one job so that its failure is its own: an error that is not an outage
        (of the database or the network: every job stalls alike, and it is waited out)
        fails this job with the error as its reason, and the tick goes on to the next job."""
        try:
            await self.schedule_job(job_id)
        except DBAPIError as exc:
            if exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError):
                raise
            await self._fail_unschedulable(job_id, exc)
        except (OSError, TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad job must not stall the others
            await self._fail_unschedulable(job_id, exc)

    async def _fail_unschedulable(self, job_id: str, exc: Exception) -> None:
        reason = f"scheduling failed: {type(exc).__name__}: {str(exc)[:300]}"
        log.error("scheduling job %s failed; failing it", job_id, exc_info=exc)
        async with self.machine.tx() as s:
            job = await s.get(Job, job_id)
            if job is not None and JobState(job.state) in (J.pending, J.running, J.paused):
                await transition_job(s, job, J.failed, reason=reason)
                log_event(log, "job failed", reason=reason)

    async def schedule_job(self, job_id: str) -> None:
        """One job's pass, in one transaction holding the job's row lock: start it if
        pending, resume it if a quota let it go, mark what the trainer stepped on, advance
        its iteration, complete it, or start the groups it has room for."""
        async with self.machine.tx() as s:
            job = await self._lock_job(s, job_id)
            if job is None:
                return
            if job.state == J.pending and not await self._start_job(s, job):
                return
            tenant = await s.get(Tenant, job.tenant_id)
            if job.state == J.paused and not await self._resume_within_quota(s, job, tenant):
                return
            if job.state != J.running:
                return
            spec = await self.machine.spec_of(s, job.id)
            if spec.is_offline:  # sft, dpo, reward_model: no episodes, the trainer steps through the data
                await self._sft_progress(s, job, spec)
                return
            if self.trainer_attached and spec.evaluate is None:
                await self.mark_trained(s, job.id)
                await self.resend_trajectories(s, job.id)
            if spec.evaluation is not None:  # evaluation jobs of the versions due (evaluation.py)
                await evaluation.start_due(s, job, spec, store=self.machine.store)
            counts = await repo.episode_counts(s, job.id)
            metrics.EPISODES_ACTIVE.labels(job.id).set(counts.active)
            await self._advance_iteration(s, job, spec, counts)
            replace = await self._replacements_due(s, job, spec, counts)
            if await self._complete_if_done(s, job, spec, counts, replace):
                return
            if spec.evaluate is not None and await evaluation.not_served(s, job, spec):
                return  # no episode before the gateway serves the version it evaluates
            await self._start_groups(s, job, spec, tenant, counts, replace)

    async def _sft_progress(self, s: AsyncSession, job: Job, spec: JobSpec) -> None:
        """A job without episodes (sft, dpo, reward_model): its iteration is the epoch its
        latest version reached; it completes once a version holds the last step
        (services.trainer.supervised)."""
        step = await s.scalar(select(func.max(PolicyVersion.step)).where(PolicyVersion.job_id == job.id))
        conversations = int(
            await s.scalar(select(func.count()).select_from(Task).where(sampleable(spec.tasks.taskset))) or 0
        )
        per_epoch, total = spec.sft_steps(conversations)
        step = int(step or 0)
        job.iteration = min(step // max(per_epoch, 1), spec.schedule.iterations - 1)
        metrics.JOB_ITERATION.labels(job.id).set(job.iteration)
        if conversations and step >= total:
            await transition_job(s, job, J.completed)
            log_event(log, "job completed", steps=step, epochs=spec.schedule.iterations)

    async def _lock_job(self, s: AsyncSession, job_id: str) -> Job | None:
        query = select(Job).where(Job.id == job_id)
        if not self.machine.db.is_sqlite:
            query = query.with_for_update()
        return (await s.execute(query)).scalar_one_or_none()

    async def current_version(self, s: AsyncSession, job: Job) -> int:
        """The job's current policy version: what new episodes carry as their behaviour
        version and what the staleness gate measures against."""
        return job.policy_version

    async def _advance_iteration(
        self, s: AsyncSession, job: Job, spec: JobSpec, counts: repo.EpisodeCounts
    ) -> None:
        """Move on once the current iteration's episodes have all started and the next
        one is fresh enough."""
        while (
            counts.started[job.iteration] >= spec.schedule.episodes_per_iteration
            and job.iteration + 1 < spec.schedule.iterations
            and await self._fresh_enough(s, job, spec, job.iteration + 1)
        ):
            job.iteration += 1
            log_event(log, "iteration started", iteration=job.iteration, policy_version=job.policy_version)
        metrics.JOB_ITERATION.labels(job.id).set(job.iteration)

    @staticmethod
    async def _replacements_due(s: AsyncSession, job: Job, spec: JobSpec, counts: repo.EpisodeCounts) -> int:
        """Groups to start in place of the ones the trainer skipped (dynamic sampling)."""
        if not spec.algorithm.dynamic_sampling:
            return 0
        return replacements_due(
            skipped=await zero_variance_groups(s, job.id),
            started=counts.started,
            iteration=job.iteration,
            per_iteration=spec.schedule.episodes_per_iteration,
            group_size=spec.tasks.group_size,
            max_per_iteration=spec.algorithm.max_replacement_groups,
        )

    async def _complete_if_done(
        self, s: AsyncSession, job: Job, spec: JobSpec, counts: repo.EpisodeCounts, replace: int
    ) -> bool:
        """Complete the job once every iteration started its own episodes and all of them
        finished (and, with ``wait_for_training``, the trainer has read them). True when the
        pass ends here."""
        per_iteration = spec.schedule.episodes_per_iteration
        total, done = sum(counts.started.values()), sum(counts.finished.values())
        # every iteration started its own episodes (replacements do not stand in for them)
        own = sum(min(n, per_iteration) for n in counts.started.values())
        if own < per_iteration * spec.schedule.iterations or done != total or replace:
            return False
        if spec.evaluate is not None:  # its results, from its episodes' verdicts
            await evaluation.finish(s, job, spec)
        if counts.failed == total:  # nothing to learn from: a failure, said with its causes
            reasons = "; ".join(f"{n} x {r}" for r, n in await repo.failure_reasons(s, job.id))
            await transition_job(s, job, J.failed, reason=f"every episode failed ({total}): {reasons}"[:1000])
            log_event(log, "job failed", reason="every episode failed", episodes=total)
            return True
        if (
            self.wait_for_training
            and spec.evaluate is None
            and not await staleness.training_done(s, job, spec)
        ):
            return True
        await transition_job(s, job, J.completed)
        metrics.EPISODES_ACTIVE.labels(job.id).set(0)
        log_event(log, "job completed", episodes=total)
        return True

    async def _start_groups(
        self,
        s: AsyncSession,
        job: Job,
        spec: JobSpec,
        tenant: Tenant | None,
        counts: repo.EpisodeCounts,
        replace: int,
    ) -> None:
        """Start groups of ``group_size`` episodes on one task each while the job, its
        tenant and the fleet leave room: the iteration's own episodes still to start, then
        one group per due replacement."""
        per_iteration, group_size = spec.schedule.episodes_per_iteration, spec.tasks.group_size
        started = counts.started
        need = max(0, per_iteration - started[job.iteration]) + replace * group_size
        if need <= 0:
            return
        if tenant is not None and (reason := await self._over_quota(s, tenant)):
            await transition_job(s, job, J.paused, reason=reason)
            log_event(log, "job paused", reason=reason)
            return
        replaced_before = replacement_groups(started[job.iteration], per_iteration, group_size)
        quota = (tenant.max_concurrent_episodes if tenant is not None else None) or DEFAULT_TENANT_QUOTA
        cap = min(spec.schedule.max_concurrent_episodes, quota)
        room = min(
            spec.schedule.max_concurrent_episodes - counts.active,
            quota - await repo.tenant_active_episodes(s, job.tenant_id, ACTIVE),
        )
        if room < min(group_size, cap):
            if (
                room < spec.schedule.max_concurrent_episodes - counts.active
            ):  # the tenant's limit, not the job's
                await self._waiting(
                    s, job, f"tenant {job.tenant_id} runs its max_concurrent_episodes ({quota})"
                )
            return
        candidates = await self._candidates(s, job, spec)
        if not candidates:
            await transition_job(
                s, job, J.failed, reason=f"task set {spec.tasks.taskset} has no task to sample"
            )
            return
        used = await repo.tasks_of_iteration(s, job.id, job.iteration)
        if spec.evaluate is not None:  # sampled by exactly the version it evaluates
            version = evaluation.behaviour_version(spec)
        else:
            version = await self.current_version(s, job)
        budget = MAX_STARTS_PER_PASS
        while need > 0 and room >= min(group_size, cap):
            if budget <= 0:
                self.machine.on_finished()  # more to start: the next pass comes at once
                break
            size = min(group_size, need)
            if not self.fleet.admit(job.tenant_id, size):
                # the fleet is full, or its room is planned for needier tenants
                await self._waiting(s, job, self.fleet.why_not(job.tenant_id))
                break
            await self._waiting(s, job, None)
            rng = random.Random(f"{spec.tasks.seed}:{job.id}:{job.iteration}:{started[job.iteration]}")
            pool = [c for c in candidates if c.task_id not in used] or candidates
            task = await self.machine.task_of(s, rng.choices(pool, [c.weight for c in pool])[0].task_id)
            used.add(task.id)
            group_id = new_id()
            for _ in range(size):
                self.machine.start_episode(
                    s,
                    job=job,
                    spec=spec,
                    task=task,
                    group_id=group_id,
                    iteration=job.iteration,
                    behaviour_version=version,
                    # an evaluation is sampled by exactly the version it evaluates
                    partial_rollouts=False if spec.evaluate is not None else None,
                )
            started[job.iteration] += size
            need -= size
            room -= size
            budget -= size
            counts.active += size
            log_event(
                log, "group started", group_id=group_id, task_id=task.id, size=size, iteration=job.iteration
            )
        replaced = replacement_groups(started[job.iteration], per_iteration, group_size) - replaced_before
        if replaced:
            metrics.DISPATCHER_REPLACEMENT_GROUPS.labels(job.id).inc(replaced)
            log_event(log, "replacement groups started", groups=replaced, iteration=job.iteration)
        metrics.EPISODES_ACTIVE.labels(job.id).set(counts.active)

    @staticmethod
    async def _waiting(s: AsyncSession, job: Job, why: str | None) -> None:
        """A job whose next episodes wait for room says so in its reason (``stuck: waiting
        for room: ...``) until they start; any other reason is left alone."""
        ours = f"{STUCK_PREFIX}{WAITING_FOR_ROOM}"
        current = job.state_reason or ""
        if why is not None and current != f"{ours}{why}":
            await mark_job_stuck(s, job.id, f"{WAITING_FOR_ROOM}{why}")
            log_event(log, "job waits for room", reason=why)
        elif why is None and current.startswith(ours):
            await mark_job_stuck(s, job.id, None)

    async def _candidates(self, s: AsyncSession, job: Job, spec: JobSpec) -> list[Candidate]:
        """The tasks an episode may be given (``temper.tasks.service.sampleable``), in id
        order, each weighed by the curriculum on this job's attempts and passes (and those
        of the job it starts from)."""
        lineage = [job.id, *filter(None, [spec.tasks.prior_from_job])]
        totals = outcome_totals(taskset_id=spec.tasks.taskset, job_ids=lineage).subquery()
        query = (
            select(Task.id, func.coalesce(totals.c.attempts, 0), func.coalesce(totals.c.passes, 0))
            .outerjoin(totals, totals.c.task_id == Task.id)
            .where(sampleable(spec.tasks.taskset, evaluation.split_of(spec)))
            .order_by(Task.id)
        )
        return [
            Candidate(task_id, task_weight(int(attempts), int(passes), spec.tasks.curriculum))
            for task_id, attempts, passes in await s.execute(query)
        ]

    @staticmethod
    async def _over_quota(s: AsyncSession, tenant: Tenant) -> str | None:
        if not has_quota(tenant):
            return None
        return quota_exceeded(tenant, (await tenant_usage(s, [tenant.id]))[tenant.id])

    async def _resume_within_quota(self, s: AsyncSession, job: Job, tenant: Tenant | None) -> bool:
        """A job paused for a quota goes on once its tenant is within its quotas again
        (an admin raised or lifted them); one paused over the API waits for a resume."""
        if not (job.state_reason or "").startswith(QUOTA_REASON) or tenant is None:
            return False
        if await self._over_quota(s, tenant):
            return False
        await transition_job(s, job, J.running, reason="resumed: within quota again")
        log_event(log, "job resumed", reason="within quota again")
        return True

    async def _start_job(self, s: AsyncSession, job: Job) -> bool:
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(root)"
            await transition_job(s, job, J.failed, reason=f"invalid spec: {where}: {first['msg']}")
            return False
        sampleable_count = await s.scalar(
            select(func.count())
            .select_from(Task)
            .where(sampleable(spec.tasks.taskset, evaluation.split_of(spec)))
        )
        if not sampleable_count:
            await transition_job(
                s, job, J.failed, reason=f"task set {spec.tasks.taskset} has no task to sample"
            )
            return False
        waiting = None if spec.is_offline else await backend_wait(s, job, spec)  # serves nothing
        if waiting is not None:
            if job.state_reason != STUCK_PREFIX + waiting:
                await mark_job_stuck(s, job.id, waiting)
                log_event(log, "job waits for a backend", reason=waiting)
            return False
        await transition_job(s, job, J.running)
        init_job_metrics(job.id)
        log_event(log, "job started", tasks=sampleable_count)
        return True

    # --- staleness and training ----------------------------------------------------------------
    async def _fresh_enough(self, s: AsyncSession, job: Job, spec: JobSpec, iteration: int) -> bool:
        """May episodes of ``iteration`` start (:func:`staleness.fresh_enough`)? Always when
        no trainer reads this dispatcher's trajectories."""
        return not self.trainer_attached or await staleness.fresh_enough(s, job, spec, iteration)

    async def mark_trained(self, s: AsyncSession, job_id: str, limit: int = 1000) -> int:
        """Scored episodes the trainer stepped on become ``trained``."""
        conn = await s.connection()
        found = [
            rows.loaded(Episode, dict(zip(repo.EPISODE_COLUMNS, r, strict=True)))
            for r in await conn.execute(repo.TRAINED, {"job_id": job_id, "limit": limit})
        ]
        for ep in found:
            transition_episode(s, ep, E.trained)
        rows.stage(s, *found)
        return len(found)

    async def resend_trajectories(self, s: AsyncSession, job_id: str, limit: int = 200) -> int:
        """The trajectory is leased like every step: a scored episode that has no row in
        the trainer's ledger ``trajectory_lease_s`` after it was scored (or last sent) is
        sent again, so a dead-lettered or lost ``TrajectoryReady`` cannot keep the job
        from completing. The trainer ignores a trajectory it already holds."""
        settings = self.machine.settings
        lease = timedelta(seconds=settings.trajectory_lease_s or settings.lease_s)
        current = utcnow()
        conn = await s.connection()
        found = [
            rows.loaded(Episode, dict(zip(repo.EPISODE_COLUMNS, r, strict=True)))
            for r in await conn.execute(
                repo.UNREAD_TRAJECTORIES, {"job_id": job_id, "before": current - lease, "limit": limit}
            )
        ]
        for ep in found:
            assert ep.trajectory_key is not None
            enqueue(
                s,
                Topics.TRAJECTORIES,
                TrajectoryReady(
                    job_id=ep.job_id,
                    episode_id=ep.id,
                    task_id=ep.task_id,
                    group_id=ep.group_id,
                    trajectory_key=ep.trajectory_key,
                    behaviour_version=ep.behaviour_version or 0,
                    reward=ep.reward or 0.0,
                ),
            )
            ep.updated_at = current  # the lease starts again
            metrics.STEP_LEASES_EXPIRED.labels("trajectory").inc()
        rows.stage(s, *found)
        if found:
            log_event(log, "trajectories sent again", episodes=len(found), lease_s=lease.total_seconds())
        return len(found)

    async def on_policy_update(self, msg: PolicyUpdate) -> None:
        """A new policy version only reads here: the trainer wrote ``Job.policy_version``, the
        ledger and the ``policy.version`` event in the transaction that sent ``msg``. What it
        trained is marked ``trained`` now rather than at the next tick."""
        if not msg.job_id:
            return
        async with self.machine.tx() as s:
            # the job's lock, as in schedule_job: one marker of its episodes at a time
            query = select(Job).where(Job.id == msg.job_id, Job.state.in_([J.running, J.completed]))
            if not self.machine.db.is_sqlite:
                query = query.with_for_update()
            job = (await s.execute(query)).scalar_one_or_none()
            if job is None:
                return
            spec = await self.machine.spec_of(s, job.id)
            if spec.evaluation is not None:  # a version published after the job completed is due too
                await evaluation.start_due(s, job, spec, store=self.machine.store)
            if self.trainer_attached and job.state == J.running and spec.evaluate is None:
                await self.mark_trained(s, msg.job_id)
                await self.resend_trajectories(s, msg.job_id)
