"""``/v1/jobs/{id}/evaluations``: evaluate one of a job's versions (or a model directory,
with the job's environment and rewards) as a job of its own, and read a job's evaluations
with their pass@k per version and, on request, per task (``services/dispatcher/evaluation.py``
makes and finishes them)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, status

from services.dispatcher import evaluation, evaluation_views
from services.dispatcher.api import schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import CurrentTenant, RuntimeDep, SessionDep
from services.dispatcher.api.jobs import AUTH, NOT_FOUND, JobDep, spec_problem
from services.dispatcher.backends import deployment
from temper.db import Job, PolicyVersion
from temper.jobspec import EvaluateSpec, JobSpec, SpecError, Split
from temper.policy.placement import missing_model_files, need_of, serve_error
from temper.provenance import local_dir
from temper.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["evaluations"], dependencies=[Depends(bearer_scheme)])


async def plan_request(
    session: SessionDep, *, job: Job, body: schemas.EvaluationRequest, settings: Settings, tenant_id: str
) -> evaluation.Plan:
    """The evaluation ``body`` asks of ``job``, every default resolved and every name checked;
    :class:`SpecError` naming each field that is wrong."""
    spec = JobSpec.model_validate(job.spec)
    if spec.evaluate is not None:
        raise SpecError(
            [("(job)", f"job {job.id} is an evaluation; evaluate job {spec.evaluate.job} instead")]
        )
    if spec.is_sft:
        raise SpecError(
            [("(job)", "an sft job has no environment or rewards to run evaluation episodes with")]
        )
    errors: list[tuple[str, str]] = []
    if (body.version is None) == (body.model is None):
        errors.append(("version", "give a version of the job or a model directory, one of the two"))
    if body.version:
        if await session.get(PolicyVersion, (job.id, body.version)) is None:
            errors.append(
                (
                    "version",
                    f"job {job.id} has not published v{body.version} (it is at v{job.policy_version})",
                )
            )
    backends = await deployment(session, settings)
    pools = {b.pool for b in backends}
    pool = body.backend_pool or spec.policy.backend_pool
    if backends and pool not in pools:
        errors.append(("backend_pool", f"no backend pool {pool!r} here; pools: {', '.join(sorted(pools))}"))
    if body.model is not None:
        directory = local_dir(body.model)
        missing = missing_model_files(directory) if directory is not None else ["a directory"]
        if missing:
            errors.append(
                ("model", f"{body.model[:80]!r} is not a complete model directory: no {', '.join(missing)}")
            )
        elif backends and (
            problem := serve_error(
                need_of("", model=spec.policy.model, init=body.model, pool=pool, lora=False), backends
            )
        ):
            errors.append(("model", problem))
    if body.passed_by not in ("default", "reward", *spec.rewards):
        errors.append(
            (
                "passed_by",
                f"{body.passed_by!r} is not default, reward or one of the job's rewards ({', '.join(sorted(spec.rewards))})",
            )
        )
    own = body.taskset is None
    split = body.split or (Split.held_out if own else Split.all)
    found, problems = await evaluation.taskset_errors(
        session, "(request)", body.taskset or spec.tasks.taskset, split.value, tenant_id=tenant_id
    )
    errors += [(field.removeprefix("(request)."), message) for field, message in problems]
    if errors or found is None:
        raise SpecError(errors)
    evaluate = EvaluateSpec(
        job=job.id, version=body.version, model=body.model, split=split, samples=body.samples,
        pass_at=list(body.pass_at), passed_by=body.passed_by, pass_threshold=body.pass_threshold,
        label=body.label, periodic=False,
    )  # fmt: skip
    return evaluation.Plan(
        source=job,
        source_spec=spec,
        evaluate=evaluate,
        taskset=found,
        sampling=body.sampling or spec.policy.sampling,
        max_concurrent_episodes=body.max_concurrent_episodes or spec.schedule.max_concurrent_episodes,
        backend_pool=pool,
    )


@router.post(
    "/{job_id}/evaluations",
    summary="Evaluate a version of a job",
    description="Evaluates one of the job's published versions (0: its initial weights), or a model "
    "directory with the job's environment and rewards, on a task set or a split of one, as a job of its own: "
    "`samples` episodes per task, each sampled by exactly that version, never trained on; pass@k per task and "
    "over the tasks once it ends (`GET /v1/jobs/{id}/evaluations`).",
    status_code=status.HTTP_201_CREATED,
    response_model=schemas.Evaluation,
    responses={
        422: {"model": schemas.Problem, "description": "a field names what cannot be evaluated"},
        **NOT_FOUND,
        **AUTH,
    },  # fmt: skip
)
async def evaluate(
    runtime: RuntimeDep,
    session: SessionDep,
    tenant: CurrentTenant,
    job: JobDep,
    body: schemas.EvaluationRequest,
) -> Any:
    try:
        plan = await plan_request(session, job=job, body=body, settings=runtime.settings, tenant_id=tenant.id)
        made = await evaluation.create(session, plan, store=runtime.store)
    except SpecError as exc:
        return spec_problem(exc)
    except evaluation.EvaluationRefused as exc:
        return spec_problem(SpecError([(exc.field, str(exc))]))
    await session.commit()
    (point,) = [
        p
        for p in await evaluation_views.points(session, made.id, own=True)
        if p["evaluation_job_id"] == made.id
    ]
    return schemas.Evaluation(**point)


@router.get(
    "/{job_id}/evaluations",
    summary="A job's evaluations",
    description="Every evaluation of the job's versions (periodic and on request), by version: its state, "
    "pass@k (the mean over the tasks of the unbiased estimator), the mean reward and each component's mean; "
    "with `tasks=true`, per task. For an evaluation job, its own.",
    response_model=list[schemas.Evaluation],
    responses={**NOT_FOUND, **AUTH},
)
async def list_evaluations(
    session: SessionDep,
    job: JobDep,
    tasks: Annotated[bool, Query(description="include each evaluation's per-task results")] = False,
) -> list[schemas.Evaluation]:
    found = await evaluation_views.points(session, job.id, own=True)
    per_task: dict[str, list[dict[str, Any]]] = {}
    if tasks:
        per_task = await evaluation_views.task_rows(session, [p["evaluation_job_id"] for p in found])
    return [
        schemas.Evaluation(**p, **({"tasks": per_task.get(p["evaluation_job_id"], [])} if tasks else {}))
        for p in found
    ]
