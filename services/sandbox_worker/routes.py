"""The sandbox worker's HTTP API: sessions, one-shot runs and SandboxFusion-compatible
``POST /run_code`` (``app.py`` builds the app around them)."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.sandbox_worker.schemas import (
    CreateSession,
    RestoreSession,
    RunCodeRequest,
    RunCodeResponse,
    RunTests,
    RunTestsResult,
    SessionCreated,
    SnapshotTaken,
)
from services.sandbox_worker.worker import SandboxWorker
from temper import metrics
from temper.sandbox import (
    Action,
    ExecResult,
    RequestRefused,
    SandboxError,
    SessionExists,
    SessionNotFound,
    SnapshotError,
)
from temper.sandbox.images import ImageError


async def get_worker(request: Request) -> SandboxWorker:
    # async: a plain function dependency would cost every request a hop to a thread
    return request.app.state.worker


WorkerDep = Annotated[SandboxWorker, Depends(get_worker)]


def local_health(app: FastAPI) -> None:
    """``/health`` and ``/metrics`` for an app serving a bare worker (no runtime)."""

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


APP_INFO: dict[str, Any] = {
    "title": "Temper sandbox worker",
    "version": "1",
    "description": "Isolated sandboxes for agent actions. See docs/sandbox.md.",
}


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as strings: JSON has no such numbers, and a 422
    that echoes the bad input must still serialise."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _refused(loc: list[str], message: str, status: int = 422) -> JSONResponse:
    return JSONResponse({"detail": [{"loc": loc, "msg": message}]}, status_code=status)


def add_routes(app: FastAPI) -> None:
    """Sessions, one-shot runs and ``POST /run_code`` on ``app.state.worker``. Bad input is
    a 4xx naming the field (422), a duplicate session id a 409; 503 is the worker's own
    failure."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(RequestRefused)
    async def _request_refused(request: Request, exc: RequestRefused) -> JSONResponse:
        return _refused(["body", *exc.field.split(".")], str(exc))

    @app.exception_handler(ImageError)
    async def _bad_image(request: Request, exc: ImageError) -> JSONResponse:
        return _refused(["body", "limits", "image"], str(exc))

    @app.exception_handler(SessionExists)
    async def _exists(request: Request, exc: SessionExists) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(SessionNotFound)
    async def _not_found(request: Request, exc: SessionNotFound) -> JSONResponse:
        return JSONResponse({"detail": f"no session {exc.args[0]}"}, status_code=404)

    @app.exception_handler(SnapshotError)
    async def _bad_snapshot(request: Request, exc: SnapshotError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

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
    async def run_code(body: RunCodeRequest, w: WorkerDep) -> Response:
        """SandboxFusion-compatible. Truncated output is reported as ``Failed``."""
        # Serialised once by the model itself: the answer is a RunCodeResponse already, and
        # FastAPI's check of it against response_model cost a validation per request.
        answer = await w.run_code(body)
        return Response(answer.model_dump_json(), media_type="application/json")
