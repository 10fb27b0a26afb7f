"""Persistence behind the API and the console: every read is scoped to a tenant, every
write goes through :mod:`temper.lifecycle`. Functions take the session explicitly and
never commit; the route does."""

from __future__ import annotations

import base64
import json
import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, String, and_, case, cast, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher import evaluation_views
from services.dispatcher.api import schemas
from services.dispatcher.sampling import replacement_groups, zero_variance_groups
from temper import provenance
from temper.clock import utcnow
from temper.db import Episode, Job, PolicyVersion, TaskOutcome, TaskSet, Tenant, TrainedTrajectory
from temper.events import LifecycleEvent, Topics
from temper.jobspec import JobSpec, SpecError
from temper.lifecycle import EPISODE_FINISHED, EpisodeState, JobState, transition_job
from temper.outbox import enqueue
from temper.storage import ObjectStore
from temper.tasks.service import task_row_id

SCORED = (EpisodeState.scored.value, EpisodeState.trained.value)
FINISHED = tuple(s.value for s in EPISODE_FINISHED)
UNUSABLE_TASKSET_STATES = frozenset({"invalid", "failed", "deleted"})


# --- cursors --------------------------------------------------------------------------


class BadCursor(ValueError):
    pass


def encode_cursor(created_at: datetime, row_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, row_id = json.loads(raw)
        at = datetime.fromisoformat(created)
        if at.tzinfo is None:
            raise ValueError("naive")
        return at, str(row_id)
    except (ValueError, TypeError) as exc:
        raise BadCursor("cursor is not one this API handed out") from exc


@dataclass
class Page:
    rows: list[Any]
    next_cursor: str | None
    total: int


async def _page(
    session: AsyncSession,
    query: Select[Any],
    model: Any,
    *,
    limit: int,
    cursor: str | None,
    offset: int,
    newest_first: bool,
) -> Page:
    total = (await session.execute(select(func.count()).select_from(query.subquery()))).scalar_one()
    if cursor:
        created, row_id = decode_cursor(cursor)
        if newest_first:
            query = query.where(
                or_(model.created_at < created, and_(model.created_at == created, model.id < row_id))
            )
        else:
            query = query.where(
                or_(model.created_at > created, and_(model.created_at == created, model.id > row_id))
            )
    order = (model.created_at.desc(), model.id.desc()) if newest_first else (model.created_at, model.id)
    query = query.order_by(*order).limit(limit + 1)
    if offset and not cursor:
        query = query.offset(offset)
    rows = list((await session.execute(query)).scalars())
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor(rows[-1].created_at, rows[-1].id)
    return Page(rows, next_cursor, total)


# --- jobs -----------------------------------------------------------------------------


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:12]


async def create_job(
    session: AsyncSession,
    *,
    tenant: Tenant,
    spec: JobSpec,
    store: ObjectStore | None = None,
    rerun_of: str | None = None,
) -> Job:
    """Insert a pending job with its provenance (:func:`temper.provenance.record`; ``store``
    to read an object-store model's files, ``rerun_of`` the job it repeats); :class:`SpecError`
    if its task set is not the tenant's or unusable."""
    taskset = await session.get(TaskSet, spec.tasks.taskset)
    if taskset is None or taskset.tenant_id != tenant.id:
        raise SpecError([("tasks.taskset", f"task set {spec.tasks.taskset!r} does not exist")])
    if taskset.status in UNUSABLE_TASKSET_STATES:
        raise SpecError([("tasks.taskset", f"task set {taskset.id!r} is {taskset.status}")])
    if spec.handle is not None and (
        taken := await job_by_handle(session, tenant_id=tenant.id, handle=spec.handle)
    ):
        raise SpecError([("handle", f"handle {spec.handle!r} is taken by job {taken.id}")])
    stored = spec.model_dump(mode="json")
    job = Job(
        id=new_job_id(),
        tenant_id=tenant.id,
        name=spec.name,
        handle=spec.handle,
        tags=list(dict.fromkeys(spec.tags)),
        note=spec.note,
        spec=stored,
        state=JobState.pending.value,
        provenance=await provenance.record(session, spec, stored, store=store, rerun_of=rerun_of),
    )
    session.add(job)
    enqueue(
        session,
        Topics.EVENTS,
        LifecycleEvent(event="job.state", job_id=job.id, tenant=tenant.id, state=JobState.pending.value),
    )
    try:
        await session.flush()
    except IntegrityError:  # a submission with the same handle won the race
        await session.rollback()
        raise SpecError([("handle", f"handle {spec.handle!r} is taken")]) from None
    return job


async def update_job(
    session: AsyncSession, *, job: Job, tags: list[str] | None, note: str | None, clear_note: bool
) -> None:
    """Replace a job's tags and/or note (its handle and spec never change)."""
    if tags is not None:
        job.tags = list(dict.fromkeys(tags))
    if note is not None or clear_note:
        job.note = note


async def list_jobs(
    session: AsyncSession,
    *,
    tenant_id: str,
    state: str | None = None,
    name: str | None = None,
    tag: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
    offset: int = 0,
) -> Page:
    query = select(Job).where(Job.tenant_id == tenant_id)
    if state:
        query = query.where(Job.state == state)
    if name:
        query = query.where(func.lower(Job.name).contains(name.lower(), autoescape=True))
    if tag:
        # tags hold no quotes (jobspec.TAG_PATTERN): '"tag"' in the JSON text is that element, whole
        query = query.where(cast(Job.tags, String).contains(json.dumps(tag), autoescape=True))
    return await _page(session, query, Job, limit=limit, cursor=cursor, offset=offset, newest_first=True)


async def get_job(session: AsyncSession, *, tenant_id: str, job_id: str) -> Job | None:
    job = await session.get(Job, job_id)
    return job if job is not None and job.tenant_id == tenant_id else None


async def job_by_handle(session: AsyncSession, *, tenant_id: str, handle: str) -> Job | None:
    query = select(Job).where(Job.tenant_id == tenant_id, Job.handle == handle)
    return (await session.execute(query)).scalar_one_or_none()


async def find_job(session: AsyncSession, *, tenant_id: str, ref: str) -> list[Job]:
    """The tenant's jobs ``ref`` names: its id, else its handle, else every job with that
    name (newest first; the caller refuses several)."""
    job = await get_job(session, tenant_id=tenant_id, job_id=ref)
    if job is None:
        job = await job_by_handle(session, tenant_id=tenant_id, handle=ref)
    return [job] if job is not None else await jobs_named(session, tenant_id=tenant_id, name=ref)


async def jobs_named(session: AsyncSession, *, tenant_id: str, name: str) -> list[Job]:
    """The tenant's jobs with exactly this name, newest first."""
    query = (
        select(Job)
        .where(Job.tenant_id == tenant_id, Job.name == name)
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(1000)
    )
    return list((await session.execute(query)).scalars())


JOB_COMMANDS = {"pause": JobState.paused, "resume": JobState.running, "cancel": JobState.cancelled}


async def command_job(session: AsyncSession, *, job: Job, command: str, reason: str | None = None) -> None:
    """Pause, resume or cancel; raises :class:`temper.lifecycle.IllegalTransition`. A
    cancelled job takes its unfinished episodes and their steps with it, in the same
    transaction (:func:`temper.lifecycle.transition_job`); results that arrive for them
    later find them finished and are ignored."""
    to = JOB_COMMANDS[command]
    await transition_job(session, job, to, reason=reason or f"{command} requested over the API")


def job_summary(job: Job) -> dict[str, Any]:
    spec = job.spec or {}
    return {
        "id": job.id,
        "name": job.name,
        "handle": job.handle,
        "tags": list(job.tags or []),
        "note": job.note,
        "state": job.state,
        "state_reason": job.state_reason,
        "iteration": job.iteration,
        "iterations": int(spec.get("schedule", {}).get("iterations", 0)),
        "policy_version": job.policy_version,
        "taskset": str(spec.get("tasks", {}).get("taskset", "")),
        "evaluates": _evaluates(spec.get("evaluate")),
        "created_at": job.created_at,
        "updated_at": job.updated_at,
        "finished_at": job.finished_at,
    }


def _evaluates(evaluate: Any) -> dict[str, Any] | None:
    """What an evaluation job evaluates, from its spec's ``evaluate`` (None for a training job)."""
    if not isinstance(evaluate, dict):
        return None
    return {k: evaluate.get(k) for k in ("job", "version", "model", "label", "split", "periodic")}


# --- episodes -------------------------------------------------------------------------


async def list_episodes(
    session: AsyncSession,
    *,
    job: Job,
    state: str | None = None,
    task: str | None = None,
    iteration: int | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    limit: int = 50,
    cursor: str | None = None,
    offset: int = 0,
) -> Page:
    query = select(Episode).where(Episode.job_id == job.id, Episode.tenant_id == job.tenant_id)
    if state:
        query = query.where(Episode.state == state)
    if task:
        # a task's key alone ("add-2") or its full id ("ts-...:add-2")
        taskset = str(((job.spec or {}).get("tasks") or {}).get("taskset", ""))
        query = query.where(Episode.task_id.in_([task, task_row_id(taskset, task)]))
    if iteration is not None:
        query = query.where(Episode.iteration == iteration)
    if min_reward is not None:
        query = query.where(Episode.reward >= min_reward)
    if max_reward is not None:
        query = query.where(Episode.reward <= max_reward)
    return await _page(session, query, Episode, limit=limit, cursor=cursor, offset=offset, newest_first=False)


async def get_episode(session: AsyncSession, *, tenant_id: str, episode_id: str) -> Episode | None:
    episode = await session.get(Episode, episode_id)
    return episode if episode is not None and episode.tenant_id == tenant_id else None


def episode_out(episode: Episode) -> schemas.Episode:
    out = schemas.Episode.model_validate(episode)
    out.has_trajectory = bool(episode.trajectory_key)
    return out


async def active_episodes(session: AsyncSession, *, tenant_id: str) -> int:
    query = select(func.count()).where(Episode.tenant_id == tenant_id, Episode.state.not_in(FINISHED))
    return int((await session.execute(query)).scalar_one())


# --- metrics --------------------------------------------------------------------------


async def _sampling(
    session: AsyncSession, job: Job, spec: dict[str, Any], per_iteration: int
) -> tuple[schemas.Sampling, int]:
    """Zero-variance skips and replacements (:mod:`services.dispatcher.sampling`), and the
    episodes of the replacement groups."""
    group_size = int(spec.get("tasks", {}).get("group_size", 1)) or 1
    query = select(func.count()).where(Episode.job_id == job.id).group_by(Episode.iteration)
    started = list((await session.execute(query)).scalars()) if per_iteration else []
    replaced = sum(replacement_groups(n, per_iteration, group_size) for n in started)
    skipped = await zero_variance_groups(session, job.id)
    sampling = schemas.Sampling(
        dynamic_sampling=bool(spec.get("algorithm", {}).get("dynamic_sampling", False)),
        zero_variance_groups=skipped,
        replacement_groups=replaced,
        unreplaced_groups=max(0, skipped - replaced),
    )
    return sampling, sum(max(0, n - per_iteration) for n in started)


async def job_metrics(
    session: AsyncSession, *, job: Job, pass_threshold: float | None = None
) -> schemas.JobMetrics:
    spec = job.spec or {}
    schedule = spec.get("schedule", {})
    iterations = int(schedule.get("iterations", 0))
    per_iteration = int(schedule.get("episodes_per_iteration", 0))
    of_job = Episode.job_id == job.id
    scored = and_(of_job, Episode.state.in_(SCORED), Episode.reward.is_not(None))

    curve_rows = await session.execute(
        select(
            Episode.iteration,
            func.count(),
            func.avg(Episode.reward),
            func.avg(Episode.reward * Episode.reward),
            func.min(Episode.reward),
            func.max(Episode.reward),
        )
        .where(scored)
        .group_by(Episode.iteration)
        .order_by(Episode.iteration)
    )
    curve = [
        schemas.IterationReward(
            iteration=it, episodes=n, mean=mean, std=math.sqrt(max(0.0, sq - mean * mean)), min=lo, max=hi
        )
        for it, n, mean, sq, lo, hi in curve_rows
    ]

    # from the outcomes the scoring transaction recorded, one per scored episode
    verdict = TaskOutcome.passed if pass_threshold is None else TaskOutcome.reward >= pass_threshold
    passed = func.sum(case((verdict, 1), else_=0))
    task_rows = await session.execute(
        select(TaskOutcome.task_id, func.count(), passed, func.avg(TaskOutcome.reward))
        .where(TaskOutcome.job_id == job.id)
        .group_by(TaskOutcome.task_id)
        .order_by(TaskOutcome.task_id)
    )
    pass_rates = [
        schemas.TaskPassRate(task_id=t, episodes=n, passed=int(p or 0), pass_rate=(p or 0) / n, mean_reward=m)
        for t, n, p, m in task_rows
    ]

    by_state = {
        s: int(n)
        for s, n in await session.execute(
            select(Episode.state, func.count()).where(of_job).group_by(Episode.state)
        )
    }
    finished = sum(n for s, n in by_state.items() if s in FINISHED)

    now = utcnow()
    first_created, last_done = (
        await session.execute(
            select(
                func.min(Episode.created_at),
                func.max(case((Episode.state.in_(FINISHED), Episode.updated_at))),
            ).where(of_job)
        )
    ).one()
    recent = (
        await session.execute(
            select(func.count()).where(
                of_job, Episode.state.in_(FINISHED), Episode.updated_at >= now - timedelta(minutes=5)
            )
        )
    ).scalar_one()
    rate = 0.0
    if first_created is not None and finished:
        end = last_done if job.state not in ("pending", "running", "paused") and last_done else now
        minutes = max((end - first_created).total_seconds() / 60, 1 / 60)
        rate = finished / minutes
    throughput = schemas.Throughput(
        episodes_finished=finished, episodes_per_min=rate, recent_episodes_per_min=recent / 5.0
    )

    lag = job.policy_version - Episode.behaviour_version
    # Scored episodes still waiting for the trainer; those it skipped (a zero-variance
    # group) stay scored but wait for nothing.
    waiting = (
        await session.execute(
            select(func.avg(lag), func.max(lag))
            .outerjoin(TrainedTrajectory, TrainedTrajectory.episode_id == Episode.id)
            .where(
                of_job,
                Episode.state == EpisodeState.scored.value,
                Episode.behaviour_version.is_not(None),
                TrainedTrajectory.skipped.is_(None),
            )
        )
    ).one()
    in_flight = (
        await session.execute(
            select(func.max(lag)).where(
                of_job, Episode.state.not_in(FINISHED), Episode.behaviour_version.is_not(None)
            )
        )
    ).scalar_one()
    staleness = schemas.Staleness(
        current_version=job.policy_version,
        max_staleness=int(schedule.get("max_staleness", 0)),
        mean=float(waiting[0]) if waiting[0] is not None else None,
        max=int(waiting[1]) if waiting[1] is not None else None,
        in_flight_max=int(in_flight) if in_flight is not None else None,
    )

    sampling, replacement_episodes = await _sampling(session, job, spec, per_iteration)
    total = iterations * per_iteration + replacement_episodes
    progress = schemas.Progress(
        state=job.state,
        iteration=job.iteration,
        iterations=iterations,
        episodes_per_iteration=per_iteration,
        episodes_total=total,
        episodes_by_state=by_state,
        finished=finished,
        fraction=min(1.0, finished / total) if total else 0.0,
    )
    return schemas.JobMetrics(
        job_id=job.id,
        progress=progress,
        sampling=sampling,
        reward_curve=curve,
        pass_rates=pass_rates,
        throughput=throughput,
        staleness=staleness,
        training=await _training(session, job, scored=sum(p.episodes for p in curve)),
        evaluations=[schemas.EvaluationPoint(**p) for p in await evaluation_views.points(session, job.id)],
        pass_threshold=pass_threshold,
    )


async def _training(session: AsyncSession, job: Job, *, scored: int) -> schemas.Training:
    """The trainer's numbers per version (from each version row), what it skipped and,
    while nothing is trained, why."""
    rows = (
        await session.execute(
            select(PolicyVersion).where(PolicyVersion.job_id == job.id).order_by(PolicyVersion.version)
        )
    ).scalars()

    def num(m: dict[str, Any], key: str) -> Any:
        value = m.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def canary(m: dict[str, Any]) -> dict[str, Any]:
        c = m.get("logprob_canary")
        if not isinstance(c, dict):
            return {}
        return {f"canary_{k}": num(c, src) for k, src in CANARY_FIELDS.items()}

    versions = [
        schemas.VersionTraining(
            version=v.version, step=v.step, train_s=v.train_s, created_at=v.created_at,
            **{k: num(v.metrics or {}, k) for k in TRAINING_FIELDS}, **canary(v.metrics or {}),
        )
        for v in rows
    ]  # fmt: skip
    of_job = TrainedTrajectory.job_id == job.id
    skipped = {
        str(reason): int(n)
        for reason, n in await session.execute(
            select(TrainedTrajectory.skipped, func.count(func.distinct(TrainedTrajectory.group_id)))
            .where(of_job, TrainedTrajectory.skipped.is_not(None))
            .group_by(TrainedTrajectory.skipped)
        )
    }
    trained = int(
        await session.scalar(select(func.count()).where(of_job, TrainedTrajectory.step.is_not(None))) or 0
    )
    reason = None
    if trained == 0 and not versions:
        if not scored:
            reason = "no episode has been scored yet"
        elif skipped:
            listed = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
            reason = f"every group so far was skipped ({listed})"
        else:
            per_step = JobSpec.model_validate(job.spec).algorithm.groups_per_step
            reason = f"waiting for {per_step} complete group{'s' if per_step != 1 else ''} for the first step"
    return schemas.Training(
        versions=versions, trained_episodes=trained, skipped_groups=skipped, not_trained_reason=reason
    )


# the logprob canary's figures on a version row (services/trainer/mismatch.py), by their metrics names
CANARY_FIELDS = {"tokens": "tokens", "mean": "mean", "max": "max", "failed_batches": "failed_batches"}

# the StepStats fields a version row carries that the metrics show
TRAINING_FIELDS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "grad_norm",
    "clip_fraction",
    "learning_rate",
    "tokens",
    "correction_weight_mean",
    "correction_capped_fraction",
)
