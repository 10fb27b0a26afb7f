"""The gateway's process: the shared runtime (bus, object store), the :class:`Gateway`
component on it, ``/health`` and ``/metrics`` from the runtime, and the proxy routes
(``routes.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI

from services.inference_gateway.agents import AgentProxy
from services.inference_gateway.component import Gateway
from services.inference_gateway.inference import Inference
from services.inference_gateway.routes import (
    GatewayApp,
    add_agent_routes,
    add_health_routes,
    add_proxy_routes,
)
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings, *, inference: Inference | None = None, **gateway_kw: Any) -> FastAPI:
    """The gateway process: the shared runtime (bus, object store; no database), the
    :class:`Gateway` component on it, ``/health`` and ``/metrics``, and the proxy routes."""
    runtime = Runtime(settings, service="inference-gateway", needs_db=False)
    gateway = Gateway(runtime, inference=inference, **gateway_kw)
    app = service_app(runtime, gateway, app_class=GatewayApp, title="Temper inference gateway")
    app.state.gateway = gateway
    app.state.inference = gateway.inference
    add_proxy_routes(app)
    add_agent_routes(app)
    return app


def proxy_app(inference: Inference, *, agents: AgentProxy | None = None) -> FastAPI:
    """The proxy alone around an :class:`Inference`, without bus or runtime (tests, tools). Its
    ``/health`` is 503 when every backend is down and lists those that are. With ``agents``,
    it serves agent episodes' base URLs too."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await inference.start()
        try:
            yield
        finally:
            await inference.stop()

    app = GatewayApp(title="Temper inference gateway (proxy only)", lifespan=lifespan)
    app.state.inference = inference
    add_health_routes(app)
    add_proxy_routes(app)
    if agents is not None:
        app.state.gateway = SimpleNamespace(agents=agents)
        add_agent_routes(app)
    return app
