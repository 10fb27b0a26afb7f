"""Evaluation jobs: how a policy version is evaluated beside training (docs/job-spec.md,
"evaluation"; docs/inference.md, "Evaluating a version").

An evaluation is a job of its own, never trained on: its spec is the evaluated job's
(environment, rewards, tools, limits) with ``evaluate`` saying what it evaluates, the task set
or split it samples, ``samples`` episodes per task (one group per task) and the evaluation's
sampling parameters. Its episodes are sampled by exactly the version they evaluate:

- the gateway serves a job one version at a time; the evaluation job is a job of the
  gateway's too, so it holds version V for as long as it runs, while the training job's own
  versions move on. At creation the dispatcher copies V's ``policy_versions`` row under the
  evaluation job's id and sends V's ``PolicyUpdate`` for it, in the same transaction: the
  gateway loads V's adapter beside the training job's (LoRA), or V's full weights on a
  backend of their own (full weights: one job's full weights per backend, so the evaluation
  waits, ``pending`` with the reason, for a free backend of its pool; ``evaluation.backend_pool``
  may name another pool);
- no episode starts before the gateway confirmed V for the evaluation job (``served_at`` on
  that row); version 0 (the job's initial weights) and a model directory need no update;
- every episode starts with ``behaviour_version`` = V, and at scoring every model turn of it
  must carry V, or the episode fails instead of counting (``evaluation_version_mismatch``).

Its episodes never send a trajectory to the trainer and never write a ``task_outcomes`` row
(so no training pass rate and no curriculum counts them): each scored one writes an
``evaluation_outcomes`` row with the evaluation's own verdict (``passed_by``). Once all have
finished, the per-task results (pass@k with the unbiased estimator, ``temper.evaluation``),
the summary and an ``evaluation`` lifecycle event for the evaluated job are written in the
transaction that completes the evaluation job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.episodes import new_id
from temper import evaluation, metrics, provenance
from temper.clock import utcnow
from temper.db import (
    Episode,
    Evaluation,
    EvaluationOutcome,
    EvaluationResult,
    Job,
    PolicyVersion,
    Task,
    rows,
)
from temper.events import LifecycleEvent, PolicyUpdate, RewardResult, Topics
from temper.jobspec import EvaluateSpec, JobSpec, Sampling, Split
from temper.lifecycle import STUCK_PREFIX, EpisodeState, JobState, mark_job_stuck
from temper.logs import log_event
from temper.outbox import enqueue
from temper.registry import prefix_of
from temper.storage import ObjectStore
from temper.tasks.service import TaskSetAmbiguous, TaskSetNotFound, get_taskset, sampleable
from temper.trajectory import Trajectory

log = logging.getLogger("temper.dispatcher.evaluation")

VERSION_MISMATCH = "evaluation_version_mismatch"
WAITING_FOR_VERSION = "waiting for the gateway to serve "


class EvaluationRefused(ValueError):
    """An evaluation that cannot be made: ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Plan:
    """An evaluation about to be made, every default resolved."""

    source: Job
    source_spec: JobSpec
    evaluate: EvaluateSpec
    taskset: str
    sampling: Sampling
    max_concurrent_episodes: int
    backend_pool: str


def split_of(spec: JobSpec) -> str:
    """The part of its task set a job's episodes draw from: an evaluation's split, else train."""
    return spec.evaluate.split.value if spec.evaluate is not None else Split.train.value


def behaviour_version(spec: JobSpec) -> int:
    """The version an evaluation job's episodes are sampled by (0: a model directory, served
    as the job's base)."""
    assert spec.evaluate is not None
    return spec.evaluate.version or 0


async def count_tasks(s: AsyncSession, taskset: str, split: str) -> int:
    return int(await s.scalar(select(func.count()).select_from(Task).where(sampleable(taskset, split))) or 0)


# --- at the door --------------------------------------------------------------------------


async def taskset_errors(
    s: AsyncSession, field: str, taskset: str, split: str, *, tenant_id: str
) -> tuple[str | None, list[tuple[str, str]]]:
    """``(task set id, errors)``: the tenant's task set named ``taskset`` (id or name) has
    tasks in ``split`` to evaluate on, and none of them is a conversation."""
    try:
        found = (await get_taskset(s, taskset, tenant=tenant_id)).id
    except TaskSetAmbiguous as exc:
        return None, [(f"{field}.taskset", str(exc))]
    except TaskSetNotFound:
        return None, [(f"{field}.taskset", f"no task set of yours has the id or name {taskset[:80]!r}")]
    if not await count_tasks(s, found, split):
        hint = (
            ": split it when you upload it (temper tasksets upload --held-out 0.2, or "
            "held_out_fraction=0.2), or evaluate on split train or all"
            if split == Split.held_out
            else ""
        )
        return found, [(f"{field}.split", f"task set {found} has no {split} tasks to evaluate on{hint}")]
    kinds = set((await s.execute(select(Task.kind).where(Task.task_set_id == found).distinct())).scalars())
    if "chat" in kinds:
        return found, [(f"{field}.taskset", "chat tasks are data for sft jobs; an evaluation runs episodes")]
    return found, []


async def section_errors(
    s: AsyncSession, spec: JobSpec, *, tenant_id: str, pools: set[str] | None
) -> list[tuple[str, str]]:
    """A training spec's ``evaluation`` section against this deployment: its task set (the
    id is stored for a name) has tasks in its split, and its backend pool exists (``pools``:
    the deployment's, None when unknown)."""
    rule = spec.evaluation
    if rule is None or rule.split is None:
        return []
    found, errors = await taskset_errors(
        s, "evaluation", rule.taskset or spec.tasks.taskset, rule.split.value, tenant_id=tenant_id
    )
    if found is not None and rule.taskset is not None:
        rule.taskset = found
    if pools is not None and rule.backend_pool is not None and rule.backend_pool not in pools:
        errors.append(
            (
                "evaluation.backend_pool",
                f"no backend pool {rule.backend_pool!r} here; pools: {', '.join(sorted(pools))}",
            )
        )
    return errors


def evaluation_spec(plan: Plan, tasks: int) -> dict[str, Any]:
    """The evaluation job's stored spec: the evaluated job's, sampling ``samples`` episodes of
    every task of the split (one group each), with nothing to train or track."""
    source, ev = plan.source_spec, plan.evaluate
    data = source.model_dump(mode="json")
    what = f"v{ev.version}" if ev.version is not None else (ev.model or "").rstrip("/").rsplit("/", 1)[-1]
    data.update(
        name=f"{source.name}: {ev.label} {what}"[:200],
        handle=None,
        note=None,
        tags=list(dict.fromkeys([*source.tags, "evaluation"]))[:20],
        tracking={},
        evaluation=None,
        evaluate=ev.model_dump(mode="json"),
    )
    data["policy"].update(sampling=plan.sampling.model_dump(mode="json"), backend_pool=plan.backend_pool)
    if ev.model is not None:  # the directory is served as the job's model, whole
        data["policy"]["init"] = ev.model
        data["algorithm"]["lora"] = None
    data["tasks"] = {
        "taskset": plan.taskset,
        "group_size": ev.samples,
        "curriculum": "uniform",
        "seed": source.tasks.seed,
        "prior_from_job": None,
    }
    data["algorithm"].update(dynamic_sampling=False)
    data["schedule"] = {
        "iterations": 1,
        "episodes_per_iteration": max(tasks, 1) * ev.samples,
        "max_concurrent_episodes": plan.max_concurrent_episodes,
        "max_staleness": 0,
    }
    return JobSpec.model_validate(data).model_dump(mode="json")


async def create(s: AsyncSession, plan: Plan, *, store: ObjectStore | None) -> Job:
    """The evaluation job, pending, with its ``evaluations`` row; for a version above 0, its
    copy of the version's row and the version's ``PolicyUpdate`` for the gateway (module
    docstring). :class:`EvaluationRefused` for a version the job has not published."""
    source, ev = plan.source, plan.evaluate
    checkpoint: PolicyVersion | None = None
    if ev.version:
        checkpoint = await s.get(PolicyVersion, (source.id, ev.version))
        if checkpoint is None:
            raise EvaluationRefused("version", f"job {source.id} has not published v{ev.version}")
    tasks = await count_tasks(s, plan.taskset, ev.split.value)
    stored = evaluation_spec(plan, tasks)
    spec = JobSpec.model_validate(stored)
    job_id = "job-" + new_id()[:12]
    record = await provenance.record(s, spec, stored, store=store)
    if checkpoint is not None:
        evaluated = spec.policy.model_copy(update={"init": prefix_of(checkpoint.checkpoint_key)})
        record["model"] = await provenance.model_provenance(
            spec.model_copy(update={"policy": evaluated}), store
        )
    record["evaluates"] = {"job": source.id, "version": ev.version, "model": ev.model}
    job = Job(
        id=job_id,
        tenant_id=source.tenant_id,
        name=spec.name,
        handle=None,
        tags=list(spec.tags),
        note=None,
        spec=stored,
        state=JobState.pending.value,
        provenance=record,
    )
    s.add(job)
    await s.flush()
    s.add(
        Evaluation(
            job_id=job_id,
            tenant_id=source.tenant_id,
            source_job_id=source.id,
            version=ev.version,
            model=ev.model,
            checkpoint_key=checkpoint.checkpoint_key if checkpoint is not None else None,
            label=ev.label,
            periodic=ev.periodic,
            periodic_key=f"{source.id}:{ev.version}:{ev.label}" if ev.periodic else None,
            taskset_id=plan.taskset,
            split=ev.split.value,
            samples=ev.samples,
            pass_at=list(ev.pass_at),
            passed_by=ev.passed_by,
            pass_threshold=ev.pass_threshold,
        )
    )
    if checkpoint is not None:
        # the evaluation job's own row of the version: the gateway confirms it (served_at) and
        # a restarted gateway loads it again, as it does the training job's newest
        s.add(
            PolicyVersion(
                job_id=job_id,
                version=checkpoint.version,
                checkpoint_key=checkpoint.checkpoint_key,
                step=checkpoint.step,
                metrics={},
                train_s=0.0,
            )
        )
        enqueue(
            s,
            Topics.POLICY_UPDATES,
            PolicyUpdate(
                job_id=job_id,
                version=checkpoint.version,
                checkpoint_key=checkpoint.checkpoint_key,
                step=checkpoint.step,
            ),
        )
    enqueue(
        s,
        Topics.EVENTS,
        LifecycleEvent(
            event="job.state", job_id=job_id, tenant=source.tenant_id, state=JobState.pending.value
        ),
    )
    await s.flush()
    log_event(
        log, "evaluation created", job_id=source.id, evaluation_job_id=job_id, version=ev.version,
        model=ev.model, tasks=tasks, samples=ev.samples, periodic=ev.periodic,
    )  # fmt: skip
    return job


def periodic_plan(job: Job, spec: JobSpec, version: int) -> Plan:
    """The evaluation of ``version`` that the job's ``evaluation`` section asks for."""
    rule = spec.evaluation
    assert rule is not None and rule.split is not None
    evaluate = EvaluateSpec(
        job=job.id,
        version=version,
        split=rule.split,
        samples=rule.samples,
        pass_at=list(rule.pass_at),
        passed_by=rule.passed_by,
        pass_threshold=rule.pass_threshold,
        label=rule.label,
        periodic=True,
    )
    return Plan(
        source=job,
        source_spec=spec,
        evaluate=evaluate,
        taskset=rule.taskset or spec.tasks.taskset,
        sampling=rule.sampling or spec.policy.sampling,
        max_concurrent_episodes=rule.max_concurrent_episodes or spec.schedule.max_concurrent_episodes,
        backend_pool=rule.backend_pool or spec.policy.backend_pool,
    )


async def start_due(s: AsyncSession, job: Job, spec: JobSpec, *, store: ObjectStore | None) -> int:
    """Create the evaluations the job's ``evaluation`` section makes due: one of every
    published version that is a multiple of ``every_versions`` (version 0, its initial
    weights, included) and has none yet. Called with the job's row lock held, so two passes
    never create one twice (``periodic_key`` is unique besides). Returns how many it made."""
    rule = spec.evaluation
    if rule is None:
        return 0
    published = set(
        (await s.execute(select(PolicyVersion.version).where(PolicyVersion.job_id == job.id))).scalars()
    )
    due = sorted(v for v in published | {0} if v % rule.every_versions == 0)
    have = set(
        (
            await s.execute(
                select(Evaluation.version).where(
                    Evaluation.source_job_id == job.id,
                    Evaluation.periodic.is_(True),
                    Evaluation.label == rule.label,
                )
            )
        ).scalars()
    )
    made = 0
    for version in due:
        if version not in have:
            await create(s, periodic_plan(job, spec, version), store=store)
            made += 1
    return made


async def not_served(s: AsyncSession, job: Job, spec: JobSpec) -> str | None:
    """Why the evaluation job's episodes cannot start yet (the gateway has not confirmed its
    version), or None; the job's reason says so meanwhile."""
    version = behaviour_version(spec)
    why = None
    if version > 0:
        row = await s.get(PolicyVersion, (job.id, version))
        if row is None or row.served_at is None:
            why = f"{WAITING_FOR_VERSION}v{version} for this evaluation"
    current = job.state_reason or ""
    if why is not None and current != STUCK_PREFIX + why:
        await mark_job_stuck(s, job.id, why)
        log_event(log, "evaluation waits for its version", version=version)
    elif why is None and current.startswith(STUCK_PREFIX + WAITING_FOR_VERSION):
        await mark_job_stuck(s, job.id, None)
    return why


def outcome(ep: Episode, spec: JobSpec, msg: RewardResult, trajectory: Trajectory) -> EvaluationOutcome | str:
    """The scored evaluation episode's verdict (a new row), or why it cannot count: a model
    turn sampled by another version than the one evaluated."""
    ev = spec.evaluate
    assert ev is not None
    wanted = behaviour_version(spec)
    for seg in trajectory.segments:
        if seg.role == "model" and seg.policy_version != wanted:
            return f"{VERSION_MISMATCH}: a turn was sampled by v{seg.policy_version}, not the evaluated v{wanted}"
    components = {k: v.model_dump(mode="json") for k, v in msg.components.items()}
    verdict = evaluation.passed_by(
        ev.passed_by, ev.pass_threshold, reward=msg.reward, components=components, result=msg
    )
    return rows.new(
        EvaluationOutcome,
        episode_id=ep.id,
        job_id=ep.job_id,
        task_id=ep.task_id,
        policy_version=wanted,
        passed=verdict,
        reward=msg.reward,
        components={k: v.value for k, v in msg.components.items()},
        created_at=utcnow(),
    )


async def finish(s: AsyncSession, job: Job, spec: JobSpec) -> dict[str, Any]:
    """Write the evaluation's per-task results and summary from its episodes' verdicts, and
    the ``evaluation`` event of the evaluated job (in the transaction that ends the
    evaluation job). Returns the summary."""
    ev = spec.evaluate
    assert ev is not None
    found = (await s.execute(select(EvaluationOutcome).where(EvaluationOutcome.job_id == job.id))).scalars()
    samples = [
        evaluation.Sample(o.task_id, o.passed, o.reward, {k: v for k, v in (o.components or {}).items()})
        for o in found
    ]
    results = evaluation.task_results(samples, ev.pass_at)
    failed = int(
        await s.scalar(
            select(func.count()).where(Episode.job_id == job.id, Episode.state == EpisodeState.failed)
        )
        or 0
    )
    tasks = await count_tasks(s, spec.tasks.taskset, ev.split.value)
    summary = evaluation.summary(results, ev.pass_at, tasks=tasks, failed=failed)
    row = await s.get(Evaluation, job.id)
    assert row is not None, f"evaluation job {job.id} has no evaluations row"
    for r in results:
        data = r.as_row()
        s.add(EvaluationResult(job_id=job.id, **data))
    row.summary = summary
    row.completed_at = utcnow()
    enqueue(
        s,
        Topics.EVENTS,
        LifecycleEvent(
            event="evaluation",
            job_id=row.source_job_id,
            tenant=row.tenant_id,
            version=row.version,
            data={
                **summary,
                "label": row.label,
                "evaluation_job_id": job.id,
                "taskset": row.taskset_id,
                "split": row.split,
                "samples": row.samples,
                "periodic": row.periodic,
                "model": row.model,
            },
        ),
    )
    log_event(
        log, "evaluation finished", evaluation_job_id=job.id, source_job_id=row.source_job_id,
        version=row.version, pass_at=summary["pass_at"], reward_mean=summary["reward_mean"],
    )  # fmt: skip
    state = "failed" if failed and not results else "completed"
    metrics.EVALUATIONS_FINISHED.labels(row.source_job_id, state).inc()
    if row.version is not None and results:
        metrics.EVALUATION_VERSION.labels(row.source_job_id, row.label).set(row.version)
        for k, value in summary["pass_at"].items():
            if value is not None:
                metrics.EVALUATION_PASS_AT.labels(row.source_job_id, row.label, k).set(value)
    return summary
