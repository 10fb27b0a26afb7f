"""HTTP face of the sandbox worker: health, metrics, sessions, one-shot runs and
SandboxFusion-compatible ``POST /run_code``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from temper import metrics
from temper.sandbox import Action, ExecResult, SandboxError, SessionNotFound, SnapshotError
from temper.settings import Mode, Settings, get_settings

from services.sandbox_worker.service import (
    CreateSession,
    RestoreSession,
    RunCodeRequest,
    RunCodeResponse,
    RunTests,
    RunTestsResult,
    SandboxWorker,
    SessionCreated,
    SnapshotTaken,
)


def get_worker(request: Request) -> SandboxWorker:
    return request.app.state.worker


WorkerDep = Annotated[SandboxWorker, Depends(get_worker)]


def _make_store(settings: Settings) -> object | None:
    try:
        from temper.storage import make_store
    except ImportError:  # storage not available: sessions work, snapshots do not
        return None
    return make_store(settings)


def create_app(settings: Settings | None = None, worker: SandboxWorker | None = None) -> FastAPI:
    """The app. Pass a started ``worker`` to share one (tests); otherwise the lifespan
    builds one from the settings and starts and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if worker is not None:
            app.state.worker = worker
            yield
            return
        s = settings or get_settings()
        store = _make_store(s)
        sandbox = s.sandbox.model_copy(update={"allow_unsafe": s.sandbox.allow_unsafe or s.allow_unsafe})
        w = SandboxWorker(sandbox, store=store, distributed=s.mode is Mode.distributed)
        await w.start()
        app.state.worker = w
        try:
            yield
        finally:
            await w.close()

    app = FastAPI(
        title="Temper sandbox worker",
        version="1",
        lifespan=lifespan,
        description="Isolated sandboxes for agent actions. See docs/sandbox.md.",
    )
    if worker is not None:
        app.state.worker = worker

    @app.exception_handler(SessionNotFound)
    async def _not_found(request: Request, exc: SessionNotFound) -> JSONResponse:
        return JSONResponse({"detail": f"no session {exc.args[0]}"}, status_code=404)

    @app.exception_handler(SnapshotError)
    async def _bad_snapshot(request: Request, exc: SnapshotError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.get("/health")
    async def health(w: WorkerDep) -> JSONResponse:
        components = w.health()
        failing = []
        if not w.manager.started:
            failing.append("sandbox: not started")
        if w.manager.leaked:
            failing.append(f"sandbox: {w.manager.leaked} leaked processes")
        if w.store is not None:
            try:
                await asyncio.wait_for(w.store.check(), timeout=3)  # type: ignore[attr-defined]
                components["storage"] = "ok"
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                components["storage"] = f"failing: {type(e).__name__}"
                failing.append("storage")
        body = {"status": "ok" if not failing else "failing", "failing": failing, "components": components}
        return JSONResponse(body, status_code=200 if not failing else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render_latest()
        return Response(body, media_type=content_type)

    @app.post("/v1/sessions", response_model=SessionCreated, status_code=201)
    async def create_session(body: CreateSession, w: WorkerDep) -> SessionCreated:
        return await w.create_session(body)

    @app.post("/v1/sessions/restore", response_model=SessionCreated, status_code=201)
    async def restore_session(body: RestoreSession, w: WorkerDep) -> SessionCreated:
        try:
            return await w.restore(body)
        except KeyError as e:  # temper.storage.NotFound
            raise HTTPException(404, f"no snapshot {body.key}") from e

    @app.post("/v1/sessions/{session_id}/actions", response_model=ExecResult)
    async def act(session_id: str, action: Action, w: WorkerDep) -> ExecResult:
        return await w.act(session_id, action)

    @app.post("/v1/sessions/{session_id}/snapshot", response_model=SnapshotTaken)
    async def snapshot(session_id: str, w: WorkerDep) -> SnapshotTaken:
        return await w.snapshot(session_id)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, w: WorkerDep) -> Response:
        await w.delete(session_id)
        return Response(status_code=204)

    @app.post("/v1/run_tests", response_model=RunTestsResult)
    async def run_tests(body: RunTests, w: WorkerDep) -> RunTestsResult:
        return await w.run_tests(body)

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(body: RunCodeRequest, w: WorkerDep) -> RunCodeResponse:
        """SandboxFusion-compatible. Truncated output is reported as ``Failed``."""
        return await w.run_code(body)

    return app
