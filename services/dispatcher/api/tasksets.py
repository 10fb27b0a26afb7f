"""``/v1/tasksets``: upload (JSONL or YAML), list, show with per-task validation status,
and (re)start validation, on the task-set library (:mod:`temper.tasks.service`). The
dispatcher's app mounts the router:

    app.include_router(make_router(current_tenant, enqueue=...))

``tenant_dependency`` is the app's auth dependency; it returns the tenant id, or an
object with an ``id``. The app keeps its started :class:`temper.runtime.Runtime` (with
database and object store) at ``app.state.runtime``, or passes ``runtime_dependency``.
"""

# no `from __future__ import annotations`: FastAPI must see the dependency aliases made in make_router
import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api.bodies import MAX_TASKSET_BYTES, read_limited
from temper.db import TaskSet
from temper.runtime import Runtime
from temper.tasks import service
from temper.tasks.models import TaskFormatError, TaskSpec, parse_tasks
from temper.tasks.splits import HeldOut, SplitError

# Queues validation and returns a job id: a blocking call (run in a thread: Celery) or a
# coroutine function (run on the loop: the in-process validation of embedded mode).
Enqueue = Callable[[str], str] | Callable[[str], Awaitable[str]]


def celery_enqueue(redis_url: str) -> Callable[[str], str]:
    """``enqueue`` on the Celery queue at ``redis_url``: queues ``temper.validate_taskset``
    for the worker service and returns the Celery task id."""
    from temper import celery_queue

    def enqueue(taskset_id: str) -> str:
        return celery_queue.enqueue(celery_queue.VALIDATE_TASKSET, taskset_id, redis_url=redis_url)

    return enqueue


def runtime_from_app(request: Request) -> Runtime:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the API has no runtime")
    return runtime  # type: ignore[no-any-return]


def tenant_id_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    for attr in ("id", "tenant_id"):
        if isinstance(getattr(value, attr, None), str):
            return str(getattr(value, attr))
    raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, "tenant dependency returned no tenant id")


async def _enqueue(enqueue: Enqueue, taskset_id: str) -> dict[str, Any]:
    try:
        if inspect.iscoroutinefunction(enqueue):
            job = await asyncio.wait_for(enqueue(taskset_id), 10)
        else:
            job = await asyncio.wait_for(asyncio.to_thread(enqueue, taskset_id), 10)
        return {"queued": True, "validation_id": job}
    except Exception as exc:  # noqa: BLE001 - report, the upload itself succeeded
        return {"queued": False, "error": f"{exc.__class__.__name__}: {exc}"[:300]}


def make_router(
    tenant_dependency: Callable[..., Any],
    *,
    runtime_dependency: Callable[..., Runtime] = runtime_from_app,
    enqueue: Enqueue,
) -> APIRouter:
    router = APIRouter(prefix="/v1/tasksets", tags=["tasksets"])
    TenantDep = Annotated[Any, Depends(tenant_dependency)]  # noqa: N806 - a type alias
    RuntimeDep = Annotated[Runtime, Depends(runtime_dependency)]  # noqa: N806

    @router.post("", status_code=status.HTTP_201_CREATED, summary="Upload a task set (JSONL or YAML)")
    async def upload(
        request: Request,
        tenant: TenantDep,
        runtime: RuntimeDep,
        name: str = Query("taskset", min_length=1, max_length=200),
        validate: bool = Query(True, description="queue the validation pipeline"),
        source: str = Query("upload", max_length=200, description="where the tasks came from"),
        held_out_fraction: float | None = Query(
            None, gt=0, lt=1, description="hold out this share of the tasks, chosen by held_out_seed"
        ),
        held_out_seed: int = Query(0, ge=0, le=2**63 - 1, description="the seed of a split by fraction"),
        held_out_field: str | None = Query(
            None,
            max_length=64,
            description="hold out the tasks whose metadata field is one of held_out_values",
        ),
        held_out_values: str | None = Query(None, max_length=2000, description="comma-separated values"),
    ) -> Any:
        tenant_id = tenant_id_of(tenant)
        held_out = _held_out_rule(held_out_fraction, held_out_seed, held_out_field, held_out_values)
        body = await read_limited(request, MAX_TASKSET_BYTES, "the task set")
        try:
            tasks = _parse_body(body, request.headers.get("content-type", ""))
        except TaskSetRejected as exc:
            return exc.response()  # type: ignore[return-value]
        assert runtime.db is not None
        async with runtime.db.session() as session:
            try:
                row = await service.create_taskset(
                    session, runtime.store, tenant_id, name, tasks, source=source, held_out=held_out
                )
            except SplitError as exc:
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
            view = service.taskset_view(row, {"pending": len(tasks)})
        view["validation"] = await _enqueue(enqueue, row.id) if validate else {"queued": False}
        return view

    @router.get("", summary="Task sets of the tenant")
    async def list_all(tenant: TenantDep, runtime: RuntimeDep) -> list[dict[str, Any]]:
        assert runtime.db is not None
        async with runtime.db.session() as session:
            rows = await service.list_tasksets(session, tenant_id_of(tenant))
            return [service.taskset_view(r, await service.status_counts(session, r.id)) for r in rows]

    @router.get("/{taskset_id}", summary="A task set with each task's validation status")
    async def show(
        taskset_id: str,
        tenant: TenantDep,
        runtime: RuntimeDep,
        tasks: bool = Query(True, description="include the per-task status list"),
    ) -> dict[str, Any]:
        assert runtime.db is not None
        async with runtime.db.session() as session:
            row = await _taskset(session, taskset_id, tenant)
            taskset_id = row.id  # a name was given
            counts = await service.status_counts(session, taskset_id)
            view = service.taskset_view(row, counts)
            done = counts.get("valid", 0) + counts.get("invalid", 0)
            view["progress"] = {"current": done, "total": row.task_count}
            if tasks:
                totals = await service.task_totals(session, taskset_id)
                view["tasks"] = [
                    service.task_view(t, totals.get(t.id, (0, 0)))
                    for t in await service.task_rows(session, taskset_id)
                ]
        return view

    @router.get("/{taskset_id}/tasks", summary="Each task's validation, pass rate and its lineage")
    async def tasks_of(
        taskset_id: str,
        tenant: TenantDep,
        runtime: RuntimeDep,
        job: str | None = Query(None, description="only this job's outcomes"),
    ) -> list[dict[str, Any]]:
        """Per task: validation status, reasons and oracle runs; attempts, passes and
        difficulty over the jobs counted; ``jobs``: per job and per policy version."""
        assert runtime.db is not None
        async with runtime.db.session() as session:
            taskset_id = (await _taskset(session, taskset_id, tenant)).id
            lineage = await service.outcome_breakdown(session, taskset_id, job_id=job)
            out = []
            for row in await service.task_rows(session, taskset_id):
                jobs = service.lineage_view(lineage.get(row.id, {}))
                totals = (sum(j["attempts"] for j in jobs), sum(j["passes"] for j in jobs))
                out.append({**service.task_view(row, totals), "jobs": jobs})
        return out

    @router.post("/{taskset_id}/validate", status_code=status.HTTP_202_ACCEPTED, summary="Queue validation")
    async def validate_again(taskset_id: str, tenant: TenantDep, runtime: RuntimeDep) -> dict[str, Any]:
        assert runtime.db is not None
        async with runtime.db.session() as session:
            taskset_id = (await _taskset(session, taskset_id, tenant)).id
        result = await _enqueue(enqueue, taskset_id)
        if not result["queued"]:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot queue validation: {result['error']}"
            )
        return {"id": taskset_id, "validation": result}

    return router


def _held_out_rule(
    fraction: float | None, seed: int, field: str | None, values: str | None
) -> HeldOut | None:
    """The upload's split (``temper.tasks.splits``) from its query parameters, or None; a 422
    naming what is wrong."""
    if fraction is None and field is None and values is None:
        return None
    listed = [v.strip() for v in (values or "").split(",") if v.strip()]
    try:
        return HeldOut(fraction=fraction, seed=seed, field=field, values=listed)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"held-out split: {where + ': ' if where else ''}{message}"
        ) from None


async def _taskset(session: AsyncSession, ref: str, tenant: Any) -> TaskSet:
    """The tenant's task set by id or name: 404 if none, 409 listing the ids if the name is
    several task sets'."""
    try:
        return await service.get_taskset(session, ref, tenant=tenant_id_of(tenant))
    except service.TaskSetNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"task set {ref} not found") from None
    except service.TaskSetAmbiguous as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None


def _parse_body(body: bytes, content_type: str) -> list[TaskSpec]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPException(422, "the task set must be UTF-8 text") from None
    filename = (
        ".yaml"
        if "yaml" in content_type
        else ".jsonl"
        if ("ndjson" in content_type or "jsonl" in content_type)
        else ""
    )
    if "application/json" in content_type:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HTTPException(422, f"not JSON: {exc}") from None
        items = doc.get("tasks") if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise HTTPException(422, "expected a list of tasks or {'tasks': [...]}")
        text = "".join(json.dumps(t) + "\n" for t in items)
        filename = ".jsonl"
    try:
        return parse_tasks(text, filename=filename)
    except TaskFormatError as exc:
        raise TaskSetRejected(exc) from None


class TaskSetRejected(Exception):
    """A task-set file that does not validate: answered 422 with one error per bad field,
    each naming its line (``{"detail", "errors": [{"line", "field", "message"}]}``)."""

    def __init__(self, exc: TaskFormatError) -> None:
        self.errors = exc.errors

    def response(self) -> JSONResponse:
        return JSONResponse(
            status_code=422,
            content={
                "detail": f"invalid task set: {len(self.errors)} error(s)",
                "errors": [
                    {"line": ln, "field": f"line {ln}: {f}", "message": m} for ln, f, m in self.errors
                ],
            },
        )
