"""The sandbox worker's process: the :class:`SandboxWorkerComponent` component on a
:class:`Runtime` (bus and object store; no database), ``/health`` and ``/metrics``, and
the HTTP API of ``routes.py``."""

from __future__ import annotations

from fastapi import FastAPI

from services.sandbox_worker.component import SandboxWorkerComponent
from services.sandbox_worker.routes import APP_INFO, add_routes, local_health
from services.sandbox_worker.worker import SandboxWorker
from temper.runtime import Runtime, service_app
from temper.settings import Settings, get_settings


def create_app(settings: Settings | None = None, worker: SandboxWorker | None = None) -> FastAPI:
    """The service's app. With ``worker`` (an already started :class:`SandboxWorker`, for
    tests) it only serves the HTTP API on it: no runtime, no bus."""
    if worker is not None:
        app = FastAPI(**APP_INFO)
        app.state.worker = worker
        local_health(app)
        add_routes(app)
        return app

    runtime = Runtime(settings or get_settings(), service="sandbox-worker", needs_db=False)
    service = SandboxWorkerComponent(runtime)
    app = service_app(runtime, service, **APP_INFO)
    app.state.service = service
    app.state.worker = service.worker
    add_routes(app)
    return app
