"""The dispatcher's process: the REST API (``/v1``), the web console (``/console``),
``/health`` and ``/metrics``, and the episode state machine, on one :class:`Runtime`.

Start order: database, bus, object store (the runtime), then the bootstrap key, then the
episode component; stop in reverse (:func:`temper.runtime.service_app`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, get_origin

from fastapi import Depends, FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.dispatcher.api import (
    checkpoints,
    episodes,
    evaluations,
    export,
    job_log,
    jobs,
    schemas,
    tenants,
)
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import current_tenant
from services.dispatcher.api.environments import make_router as make_environment_router
from services.dispatcher.api.tasksets import Enqueue, celery_enqueue
from services.dispatcher.api.tasksets import make_router as make_taskset_router
from services.dispatcher.component import BootstrapKey, Dispatcher
from services.dispatcher.console import routes as console
from temper import problems
from temper.jobspec import JobSpec
from temper.runtime import Component, Runtime, service_app
from temper.settings import Mode, Settings
from temper.tasks.inprocess import InProcessValidation

API_DESCRIPTION = """\
Submit RL post-training jobs, follow their episodes and read their transcripts and metrics.

Every `/v1` route needs an API key: `Authorization: Bearer <key>`. Everything a key can
see belongs to its tenant; another tenant's job or episode answers 404.
"""


def create_app(
    settings: Settings,
    *,
    run_episodes: bool = True,
    executors: Callable[[Runtime], Sequence[Component]] | None = None,
) -> FastAPI:
    """The dispatcher app. ``run_episodes=False`` serves the API and console without the
    episode component (API tests, read-only replicas). ``executors`` builds components
    started on the same runtime before the episode state machine (``temper serve``: the other
    services in this process)."""
    runtime = Runtime(settings, service="dispatcher")
    dispatcher = Dispatcher(runtime) if run_episodes else None
    components: list[Component] = [BootstrapKey(runtime)]
    if executors is not None:
        components.extend(executors(runtime))
    if dispatcher is not None:
        components.append(dispatcher)
    app = service_app(
        runtime,
        *components,
        title="Temper dispatcher",
        version="1",
        summary="REST API of Temper, the RL post-training platform for LLM agents",
        description=API_DESCRIPTION,
        dependencies=[Depends(known_query_parameters)],
    )
    app.state.settings = settings
    app.state.dispatcher = dispatcher
    app.include_router(jobs.router)
    app.include_router(job_log.router)
    app.include_router(episodes.router)
    app.include_router(tenants.router)
    app.include_router(export.router)
    app.include_router(checkpoints.router)
    app.include_router(evaluations.router)
    # Embedded mode validates task sets in this process: no Celery worker, no Redis.
    enqueue: Enqueue = (
        InProcessValidation(runtime).enqueue
        if settings.mode is Mode.embedded
        else celery_enqueue(settings.redis.url)
    )
    app.include_router(  # /v1/tasksets, from the task-set library
        make_taskset_router(current_tenant, enqueue=enqueue),
        dependencies=[Depends(bearer_scheme)],
        responses={**TASKSET_ERRORS, **jobs.AUTH},
    )
    app.include_router(  # /v1/environments: tenant environment packages
        make_environment_router(current_tenant),
        dependencies=[Depends(bearer_scheme)],
        responses={**ENVIRONMENT_ERRORS, **jobs.AUTH},
    )
    install_error_handlers(app)
    console.mount(app)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/console/", status_code=307)

    _document_job_spec(app)
    return app


def _query_params(dependant: Dependant) -> dict[str, bool]:
    """Query parameter name -> whether it may repeat (a list parameter)."""
    params = {
        p.alias: get_origin(p.field_info.annotation) in (list, set, tuple, frozenset)
        for p in dependant.query_params
    }
    for sub in dependant.dependencies:
        params.update(_query_params(sub))
    return params


def known_query_parameters(request: Request) -> None:
    """A ``/v1`` route refuses query parameters it does not declare (a typo such as
    ``?stat=failed`` would otherwise list every job) and a single-valued one given twice
    (which value counts would be a guess)."""
    route = request.scope.get("route")
    if not request.url.path.startswith("/v1") or not isinstance(route, APIRoute):
        return
    declared = _query_params(route.dependant)
    errors = []
    for name in dict.fromkeys(request.query_params):
        if name not in declared:
            errors.append(
                {"loc": ("query", name[:80]), "msg": "unknown query parameter", "type": "extra_forbidden"}
            )
        elif not declared[name] and len(request.query_params.getlist(name)) > 1:
            errors.append({"loc": ("query", name), "msg": "given more than once", "type": "too_long"})
    if errors:
        raise RequestValidationError(errors)


TASKSET_ERRORS: schemas.Responses = {
    404: {"model": schemas.Problem, "description": "no such task set for this tenant"},
    413: {"model": schemas.Problem, "description": "the upload is too large"},
    503: {"model": schemas.Problem, "description": "validation could not be queued"},
}
ENVIRONMENT_ERRORS: schemas.Responses = {
    404: {"model": schemas.Problem, "description": "no such environment package for this tenant"},
    409: {"model": schemas.Problem, "description": "the version exists with other content"},
    413: {"model": schemas.Problem, "description": "the upload is too large"},
    415: {"model": schemas.Problem, "description": "the body is not a tar.gz"},
}
MAX_MESSAGE = 300  # characters of one error message: never echo a huge input back


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    return problems.field_path(loc, root="(request)")


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers with one body, :class:`schemas.Problem`; a 422 names each bad
    field (its path, what is wrong) and never repeats the input."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            schemas.FieldError(field=_field(e.get("loc", ())), message=problems.message(e))
            for e in list(exc.errors())[:100]
        ]
        first = errors[0] if errors else schemas.FieldError(field="(request)", message="invalid")
        body = schemas.Problem(detail=f"invalid request: {first.field}: {first.message}", errors=errors)
        return JSONResponse(body.model_dump(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        body = schemas.Problem(detail=detail[:1000])
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


def conform(schema: dict[str, Any]) -> dict[str, Any]:
    """What FastAPI cannot say by itself: every 422 is a Problem (not FastAPI's
    HTTPValidationError), a body that is not JSON answers 400, ``/metrics`` is text and
    ``/health`` may answer 503."""
    problem = {"application/json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            if "422" in responses or op.get("parameters") or op.get("requestBody"):
                responses["422"] = {
                    "description": "invalid request: each bad field is named",
                    "content": problem,
                }
            if op.get("requestBody") and path != "/v1/jobs" and "400" not in responses:
                responses["400"] = {"description": "the body is not valid JSON", "content": problem}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    metrics_get = schema["paths"].get("/metrics", {}).get("get")
    if metrics_get:
        metrics_get["responses"]["200"] = {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    health_get = schema["paths"].get("/health", {}).get("get")
    if health_get:
        health = {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}
        health_get["responses"]["200"] = {"description": "every component is up", "content": health}
        health_get["responses"]["503"] = {
            "description": "a component is down: `down` names it",
            "content": health,
        }
        components["Health"] = {
            "type": "object",
            "properties": {
                "service": {"type": "string"},
                "status": {"type": "string", "enum": ["ok", "down"]},
                "components": {"type": "object", "additionalProperties": {"type": "string"}},
                "down": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["service", "status", "components"],
        }
    return schema


def _document_job_spec(app: FastAPI) -> None:
    """``POST /v1/jobs`` reads its body itself (JSON, YAML or a file); put the JobSpec
    schema into the OpenAPI components so the JSON form is documented."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, sub in spec_schema.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components["JobSpec"] = spec_schema
        conform(schema)
        schema["components"]["schemas"] = dict(sorted(components.items()))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
