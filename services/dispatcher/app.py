"""The dispatcher's process: the REST API (``/v1``), the web console (``/console``),
``/health`` and ``/metrics``, and the episode engine, on one :class:`Runtime`.

Start order: database, bus, object store (the runtime), then the bootstrap key, then the
episode component; stop in reverse (:func:`temper.runtime.service_app`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import RedirectResponse

from services.dispatcher.api import episodes, export, jobs, tenants
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import current_tenant
from services.dispatcher.component import BootstrapKey, Dispatcher
from services.dispatcher.console import routes as console
from temper.jobspec import JobSpec
from temper.runtime import Component, Runtime, service_app
from temper.settings import Mode, Settings
from temper.tasks.inprocess import InProcessValidation
from temper.tasks.routes import Enqueue, celery_enqueue
from temper.tasks.routes import make_router as make_taskset_router

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
    started on the same runtime before the episode engine (``temper serve``: the other
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
    )
    app.state.settings = settings
    app.state.dispatcher = dispatcher
    app.include_router(jobs.router)
    app.include_router(episodes.router)
    app.include_router(tenants.router)
    app.include_router(export.router)
    # Embedded mode validates task sets in this process: no Celery worker, no Redis.
    enqueue: Enqueue = (
        InProcessValidation(runtime).enqueue if settings.mode is Mode.embedded else celery_enqueue
    )
    app.include_router(  # /v1/tasksets, from the task-set library
        make_taskset_router(current_tenant, enqueue=enqueue),
        dependencies=[Depends(bearer_scheme)],
        responses=jobs.AUTH,
    )
    console.mount(app)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/console/", status_code=307)

    _document_job_spec(app)
    return app


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
        schema["components"]["schemas"] = dict(sorted(components.items()))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
