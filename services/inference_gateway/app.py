"""The gateway's process: the :class:`Gateway` component on a :class:`Runtime` (bus and
object store; no database), ``/health`` and ``/metrics``, and the OpenAI-compatible proxy
(``routes.py``): ``POST /v1/completions`` and ``POST /v1/chat/completions`` in vLLM's
shapes, with token ids and the ``policy_version``; a call with an ``X-Temper-Episode``
header is traced, routed sticky and (chat) extended token-wise across turns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from services.inference_gateway.component import Gateway
from services.inference_gateway.inference import InferenceService
from services.inference_gateway.routes import GatewayApp, ServiceDep, add_proxy_routes
from temper import metrics
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings, *, service: InferenceService | None = None, **gateway_kw: Any) -> FastAPI:
    runtime = Runtime(settings, service="inference-gateway", needs_db=False)
    gateway = Gateway(runtime, service=service, **gateway_kw)
    app = service_app(runtime, gateway, app_class=GatewayApp, title="Temper inference gateway")
    app.state.gateway = gateway
    app.state.service = gateway.service
    add_proxy_routes(app)
    return app


def proxy_app(service: InferenceService) -> FastAPI:
    """The proxy alone around a service, without bus or runtime (tests, benchmarks). Its
    ``/health`` is 503 when every backend is down and lists those that are."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = GatewayApp(title="Temper inference gateway (proxy only)", lifespan=lifespan)
    app.state.service = service

    @app.get("/health")
    async def health(svc: ServiceDep) -> JSONResponse:
        snap = svc.router.snapshot()
        down = [b["name"] for b in snap if not b["healthy"]]
        ok = len(down) < len(snap)
        body = {"status": "ok" if ok else "down", "policy_version": svc.policy_version, "down": down}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        body, ctype = metrics.render_latest()
        return Response(body, media_type=ctype)

    add_proxy_routes(app)
    return app
