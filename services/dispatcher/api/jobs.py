"""``/v1/jobs``: submit a job spec (JSON, YAML, or an uploaded YAML file), list, read,
pause, resume, cancel, and read a job's metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.dispatcher import evaluation
from services.dispatcher.api import repo, schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.bodies import MAX_SPEC_BYTES, read_limited, too_large
from services.dispatcher.api.deps import CurrentTenant, RuntimeDep, SessionDep
from services.dispatcher.api.validation import check_names, check_template, load_document, strict_spec
from services.dispatcher.backends import deployment
from temper import problems
from temper.db import Job
from temper.envpkg import service as envpkg
from temper.jobspec import TAG_PATTERN, JobSpec, SpecError, submitted_errors
from temper.lifecycle import IllegalTransition, JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(bearer_scheme)])

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
# every route that takes a job reference (an id, a handle or a name)
NOT_FOUND: schemas.Responses = {
    404: {"model": schemas.Problem, "description": "no such job for this tenant"},
    409: {"model": schemas.Problem, "description": "the name given is several jobs' (give the id or handle)"},
}
BAD_CURSOR: schemas.Responses = {
    400: {"model": schemas.Problem, "description": "the cursor is not one we gave"}
}
MAX_OFFSET = (1 << 31) - 1  # a 32-bit integer column's range: larger never matches and overflows Postgres
AUTH: schemas.Responses = {401: {"model": schemas.Problem, "description": "missing or invalid API key"}}

SPEC_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the job spec (docs/job-spec.md) as JSON, as YAML text, or as an uploaded YAML/JSON file "
        "in the form field `spec`",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
            "application/yaml": {"schema": {"type": "string"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"spec": {"type": "string", "format": "binary"}},
                    "required": ["spec"],
                }
            },
        },
    }
}


def spec_problem(exc: SpecError) -> JSONResponse:
    body = schemas.Problem(
        detail=f"invalid job spec: {problems.one_line(exc.errors[0][0], limit=200)}: {problems.one_line(exc.errors[0][1])}",
        errors=[schemas.FieldError(field=path, message=msg) for path, msg in exc.errors[:100]],
    )
    return JSONResponse(body.model_dump(), status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


FORM_OVERHEAD = 64 << 10  # a multipart form's boundaries and headers around the file
UNSUPPORTED = "send the spec as application/json, application/yaml, or multipart/form-data with a 'spec' file"


async def read_spec(request: Request) -> JobSpec:
    """The spec from whichever form the request carries it in, checked for shape and types."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in ("application/json", "multipart/form-data", *YAML_TYPES):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, UNSUPPORTED)
    if ctype == "multipart/form-data":
        raw = await read_upload(request)
    else:
        raw = await read_limited(request, MAX_SPEC_BYTES, "the job spec")
    return strict_spec(load_document(raw, json_body=ctype == "application/json"))


async def read_upload(request: Request) -> bytes:
    """The ``spec`` file (or the first file) of a multipart form; a form declared larger than
    a spec and its form's framing is refused before it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_SPEC_BYTES + FORM_OVERHEAD:
        raise too_large("the job spec", MAX_SPEC_BYTES)
    try:
        form = await request.form(max_files=10, max_fields=100)
    except StarletteHTTPException as exc:  # starlette's answer to a malformed form
        raise SpecError([("(document)", f"not a valid multipart form: {str(exc.detail)[:200]}")]) from None
    try:  # closing the form removes the uploaded files' temporary storage
        upload = form.get("spec")
        if upload is None:
            upload = next((v for v in form.values() if isinstance(v, UploadFile)), None)
        if upload is None:
            raise SpecError([("(document)", "upload the spec in the form field 'spec'")])
        if isinstance(upload, UploadFile):
            data = await upload.read(MAX_SPEC_BYTES + 1)
            if len(data) > MAX_SPEC_BYTES:
                raise too_large("the job spec", MAX_SPEC_BYTES)
            return data
        return str(upload).encode()
    finally:
        await form.close()


async def job_or_404(session: SessionDep, tenant: CurrentTenant, job_id: str) -> Job:
    """The tenant's job by id, by handle, or by name when exactly one of its jobs has that
    name (a name several jobs share answers 409 listing them, newest first)."""
    named = await repo.find_job(session, tenant_id=tenant.id, ref=job_id)
    if len(named) > 1:
        listed = ", ".join(j.id for j in named[:20]) + (", ..." if len(named) > 20 else "")
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job name {job_id!r} names {len(named)} jobs of yours ({listed}); give the id",
        )
    if not named:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} not found")
    return named[0]


JobDep = Annotated[Job, Depends(job_or_404)]


async def check_evaluation(session: SessionDep, *, spec: JobSpec, runtime: Any, tenant_id: str) -> None:
    """A submitted spec carries no ``evaluate`` (the server makes evaluation jobs), and its
    ``evaluation`` section names a task set of the tenant with tasks in its split, and a pool
    this deployment has."""
    errors = submitted_errors(spec)
    backends = await deployment(session, runtime.settings)
    pools = {b.pool for b in backends} if backends else None
    errors += await evaluation.section_errors(session, spec, tenant_id=tenant_id, pools=pools)
    if errors:
        raise SpecError(errors)


def job_detail(job: Job) -> schemas.Job:
    return schemas.Job(**repo.job_summary(job), spec=job.spec, provenance=job.provenance)


@router.post(
    "",
    summary="Submit a job",
    description="Validates the spec strictly (no type coercion, no YAML aliases, bounded size, depth and "
    "integers) and checks every name it references (environment kind, reward components, model, backend "
    "pool, task set) against this deployment, and that the model's chat template renders the job's "
    "conversation (its tools, a tool call and its result); the job starts in state `pending` and the "
    "scheduler picks it up.",
    status_code=status.HTTP_201_CREATED,
    response_model=schemas.Job,
    responses={
        422: {"model": schemas.Problem, "description": "the spec is invalid; each bad field is named"},
        415: {"model": schemas.Problem, "description": "the body is not JSON, YAML or a form upload"},
        **AUTH,
    },
    openapi_extra=SPEC_BODY,
)
async def submit_job(
    request: Request, runtime: RuntimeDep, session: SessionDep, tenant: CurrentTenant
) -> Any:
    try:
        spec = await read_spec(request)
        await check_names(
            session, spec=spec, settings=runtime.settings, tenant_id=tenant.id, store=runtime.store
        )
        await check_evaluation(session, spec=spec, runtime=runtime, tenant_id=tenant.id)
        await envpkg.pin(runtime.store, tenant_id=tenant.id, spec=spec)
        await check_template(session, spec=spec, store=runtime.store)
        job = await repo.create_job(session, tenant=tenant, spec=spec, store=runtime.store)
    except SpecError as exc:
        return spec_problem(exc)
    await session.commit()
    return job_detail(job)


@router.post(
    "/{job_id}/rerun",
    summary="Submit a job again",
    description="A new job from this job's stored, resolved spec (the same task set, model, algorithm and "
    "seeds), checked as a submitted spec is; its provenance names the job it repeats (`rerun_of`). The handle "
    "is not copied (it names one job); give the new job one, or a new name, in the body.",
    status_code=status.HTTP_201_CREATED,
    response_model=schemas.Job,
    responses={
        422: {
            "model": schemas.Problem,
            "description": "the spec no longer passes (a task set deleted, a handle taken)",
        },
        **NOT_FOUND,
        **AUTH,
    },
)
async def rerun_job(
    runtime: RuntimeDep,
    session: SessionDep,
    tenant: CurrentTenant,
    job: JobDep,
    change: schemas.Rerun | None = None,
) -> Any:
    data = {**job.spec, "handle": change.handle if change else None}
    if change is not None and change.name is not None:
        data["name"] = change.name
    try:
        spec = strict_spec(data)
        await check_names(
            session, spec=spec, settings=runtime.settings, tenant_id=tenant.id, store=runtime.store
        )
        await check_evaluation(session, spec=spec, runtime=runtime, tenant_id=tenant.id)
        await envpkg.pin(runtime.store, tenant_id=tenant.id, spec=spec)
        await check_template(session, spec=spec, store=runtime.store)
        new = await repo.create_job(session, tenant=tenant, spec=spec, store=runtime.store, rerun_of=job.id)
    except SpecError as exc:
        return spec_problem(exc)
    await session.commit()
    return job_detail(new)


@router.get("", summary="List jobs", response_model=schemas.JobPage, responses={**BAD_CURSOR, **AUTH})
async def list_jobs(
    session: SessionDep,
    tenant: CurrentTenant,
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
    name: Annotated[
        str | None, Query(description="only jobs whose name contains this (case-insensitive)")
    ] = None,
    tag: Annotated[str | None, Query(pattern=TAG_PATTERN, description="only jobs with this tag")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None, Query(min_length=1, max_length=500, description="next_cursor of the previous page")
    ] = None,
    offset: Annotated[
        int, Query(ge=0, le=MAX_OFFSET, description="skip this many (ignored with cursor)")
    ] = 0,
) -> schemas.JobPage:
    try:
        page = await repo.list_jobs(
            session,
            tenant_id=tenant.id,
            state=state.value if state else None,
            name=name,
            tag=tag,
            limit=limit,
            cursor=cursor,
            offset=offset,
        )
    except repo.BadCursor as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
    return schemas.JobPage(
        items=[schemas.JobSummary(**repo.job_summary(j)) for j in page.rows],
        next_cursor=page.next_cursor,
        total=page.total,
    )


@router.get("/{job_id}", summary="Get a job", response_model=schemas.Job, responses={**NOT_FOUND, **AUTH})
async def get_job(job: JobDep) -> schemas.Job:
    return job_detail(job)


@router.patch(
    "/{job_id}",
    summary="Change a job's tags or note",
    description="Replaces `tags` and/or `note` (null clears the note); the spec and the handle never change.",
    response_model=schemas.Job,
    responses={**NOT_FOUND, **AUTH},
)
async def update_job(session: SessionDep, job: JobDep, change: schemas.JobChange) -> schemas.Job:
    given = change.model_fields_set
    await repo.update_job(
        session, job=job, tags=change.tags if "tags" in given else None, note=change.note,
        clear_note="note" in given and change.note is None,
    )  # fmt: skip
    await session.commit()
    await session.refresh(job)
    return job_detail(job)


async def _command(session: SessionDep, job: Job, command: str) -> schemas.Job:
    try:
        await repo.command_job(session, job=job, command=command)
    except IllegalTransition:
        raise HTTPException(status.HTTP_409_CONFLICT, f"cannot {command} a job that is {job.state}") from None
    await session.commit()
    return job_detail(job)


CONFLICT: schemas.Responses = {
    409: {
        "model": schemas.Problem,
        "description": "the job's state does not allow this, or the name given is several jobs'",
    }
}


@router.post(
    "/{job_id}/pause",
    summary="Pause a running job",
    response_model=schemas.Job,
    description="No new episodes start; episodes in flight finish.",
    responses={**NOT_FOUND, **CONFLICT, **AUTH},
)
async def pause_job(session: SessionDep, job: JobDep) -> schemas.Job:
    return await _command(session, job, "pause")


@router.post(
    "/{job_id}/resume",
    summary="Resume a paused job",
    response_model=schemas.Job,
    responses={**NOT_FOUND, **CONFLICT, **AUTH},
)
async def resume_job(session: SessionDep, job: JobDep) -> schemas.Job:
    return await _command(session, job, "resume")


@router.post(
    "/{job_id}/cancel",
    summary="Cancel a job",
    response_model=schemas.Job,
    description="The job and its unfinished episodes become `cancelled`.",
    responses={**NOT_FOUND, **CONFLICT, **AUTH},
)
async def cancel_job(session: SessionDep, job: JobDep) -> schemas.Job:
    return await _command(session, job, "cancel")


@router.get(
    "/{job_id}/metrics",
    summary="Job metrics",
    description="Reward curve per iteration (mean/std of scored episodes), pass rate per task, throughput, "
    "staleness and progress.",
    response_model=schemas.JobMetrics,
    responses={**NOT_FOUND, **AUTH},
)
async def job_metrics(
    session: SessionDep,
    job: JobDep,
    pass_threshold: Annotated[
        float | None, Query(ge=-1e9, le=1e9, allow_inf_nan=False, description=schemas.PASS_THRESHOLD)
    ] = None,
) -> schemas.JobMetrics:
    return await repo.job_metrics(session, job=job, pass_threshold=pass_threshold)
