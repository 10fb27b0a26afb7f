"""The dispatcher's process: the REST API (``/v1``), the web console (``/console``),
``/health`` and ``/metrics``, and the episode engine, on one :class:`Runtime`.

Start order: database, bus, object store (the runtime), then the bootstrap key, then the
engine; stop in reverse.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import RedirectResponse

from services.dispatcher.api import episodes, jobs, tenants
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import current_tenant
from services.dispatcher.console import routes as console
from temper.jobspec import JobSpec
from temper.logs import log_event
from temper.runtime import Runtime, health_router
from temper.settings import Settings
from temper.tenants import ensure_bootstrap_key

log = logging.getLogger("temper.dispatcher")

API_DESCRIPTION = """\
Submit RL post-training jobs, follow their episodes and read their transcripts and metrics.

Every `/v1` route needs an API key: `Authorization: Bearer <key>`. Everything a key can
see belongs to its tenant; another tenant's job or episode answers 404.
"""


def _optional(module: str, attr: str) -> Any:
    """``module.attr`` if that module exists yet, else None (parts built separately)."""
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None
        raise


def _engine_class() -> Any:
    return _optional("services.dispatcher.component", "Dispatcher")


def create_app(settings: Settings, *, engine: bool = True) -> FastAPI:
    """The dispatcher app. ``engine=False`` serves the API and console without running
    episodes (API tests, read-only replicas)."""
    runtime = Runtime(settings, service="dispatcher")
    engine_cls = _engine_class() if engine else None
    dispatcher = engine_cls(runtime) if engine_cls is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        if settings.api.bootstrap_key is not None:
            assert runtime.db is not None
            async with runtime.db.session() as session:
                if await ensure_bootstrap_key(session, settings.api.bootstrap_key.get_secret_value()):
                    log_event(log, "bootstrap admin key stored for tenant 'default'")
        if dispatcher is not None:
            await dispatcher.start()
        try:
            yield
        finally:
            if dispatcher is not None:
                await dispatcher.stop()
            await runtime.stop()

    app = FastAPI(
        title="Temper dispatcher",
        version="1",
        summary="REST API of Temper, the RL post-training platform for LLM agents",
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.settings = settings
    app.state.dispatcher = dispatcher
    app.include_router(health_router(runtime))
    app.include_router(jobs.router)
    app.include_router(episodes.router)
    app.include_router(tenants.router)
    make_taskset_router = _optional("temper.tasks.routes", "make_router")
    if make_taskset_router is not None:  # /v1/tasksets, from the task-set library
        app.include_router(
            make_taskset_router(current_tenant), dependencies=[Depends(bearer_scheme)], responses=jobs.AUTH
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
