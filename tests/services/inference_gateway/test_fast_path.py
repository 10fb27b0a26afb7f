"""The gateway's ASGI fast path for ``POST /v1/completions`` (``GatewayApp``): the same answers
as through FastAPI's middleware and router, and every other request still through FastAPI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.middleware.base import BaseHTTPMiddleware

from services.inference_gateway.app import proxy_app
from services.inference_gateway.backends import Backend, BackendResult, GenerateRequest, Served
from services.inference_gateway.inference import Inference
from services.inference_gateway.routes import GatewayApp
from temper.settings.inference import BackendSpec, InferenceSettings

pytestmark = pytest.mark.timeout(30)


class FakeBackend(Backend):
    async def complete(self, req: GenerateRequest) -> BackendResult:
        return BackendResult(
            prompt_ids=req.prompt_ids,
            token_ids=[7, 8],
            logprobs=[-0.5, -1.25],
            text="ab",
            finish_reason="length",
            stop_reason=None,
            policy_version=3,
            backend=self.name,
        )

    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        return 0.0

    async def served(self) -> Served:
        return Served(base="m")

    async def release(self, job_id: str) -> float:
        return 0.0

    async def health(self) -> bool:
        return True


async def make_app(tmp_path: Path, *, backends: bool = True) -> GatewayApp:
    cfg = InferenceSettings(backends=[], checkpoint_cache_dir=str(tmp_path / "cache"))
    fakes = [FakeBackend(BackendSpec(name="f0", url="http://fake"), model_name="m")] if backends else []
    inference = Inference(cfg, backends=fakes)
    await inference.start(health_loop=False)  # what the backend serves, as the app's lifespan would
    app = proxy_app(inference)
    assert isinstance(app, GatewayApp)
    return app


async def post(
    app: GatewayApp, body: Any, *, fast: bool, headers: dict[str, str] | None = None
) -> httpx.Response:
    routes = app.fast_routes
    if not fast:
        app.fast_routes = {}  # the same handler, reached through FastAPI's middleware and router
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await c.post(
                "/v1/completions",
                content=content,
                headers={"content-type": "application/json", **(headers or {})},
            )
    finally:
        app.fast_routes = routes


def comparable(r: httpx.Response) -> tuple[int, str | None, str | None, Any]:
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return r.status_code, r.headers.get("content-type"), r.headers.get("x-temper-policy-version"), body


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        {"max_tokens": 2},  # no prompt
        {"prompt": [1, "a"]},
        {"prompt": [1, 2], "temperature": -1, "top_p": 0},
        {"prompt": [1, 2], "stream": True},
        {"prompt": []},
        {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]},
        {"prompt": "hello", "max_tokens": 2, "logprobs": 0},
        {"prompt": [1, 2, 3], "max_tokens": 2, "stop": "x", "seed": 4},
    ],
)
async def test_fast_path_answers_like_fastapi(tmp_path: Path, body: Any) -> None:
    app = await make_app(tmp_path)
    fast, slow = await post(app, body, fast=True), await post(app, body, fast=False)
    assert comparable(fast) == comparable(slow)
    assert fast.status_code in (200, 400, 422)


async def test_fast_path_error_bodies(tmp_path: Path) -> None:
    app = await make_app(tmp_path)
    r = await post(app, {"max_tokens": 2}, fast=True)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "missing"
    assert r.json()["detail"][0]["loc"] == ["prompt"]
    r = await post(app, {"prompt": [1], "stream": True}, fast=True)
    assert (r.status_code, r.json()) == (400, {"detail": "stream=true is not supported by the gateway"})
    r = await post(
        await make_app(tmp_path, backends=False), {"prompt": [1]}, fast=True
    )  # request.app.state.inference
    assert r.status_code == 502 and r.json()["detail"].startswith("generation failed: no backend configured")


async def test_fast_path_records_the_episode_trace(tmp_path: Path) -> None:
    app = await make_app(tmp_path)
    r = await post(app, {"prompt": [5, 6], "logprobs": 0}, fast=True, headers={"X-Temper-Episode": "ep"})
    assert r.status_code == 200 and r.headers["x-temper-policy-version"] == "3"
    assert r.json()["choices"][0]["token_ids"] == [7, 8] and r.json()["id"].startswith("cmpl-")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        calls = (await c.get("/v1/traces/ep")).json()["calls"]
    assert [(x["prompt_ids"], x["token_ids"], x["endpoint"]) for x in calls] == [
        ([5, 6], [7, 8], "completions")
    ]


async def test_fast_path_skips_the_middleware_and_other_requests_do_not(tmp_path: Path) -> None:
    app = await make_app(tmp_path)
    assert (await post(app, {"prompt": [1]}, fast=True)).status_code == 200
    assert app.middleware_stack is None  # FastAPI builds it on the first request it serves
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert (await c.get("/v1/completions")).status_code == 405
        assert app.middleware_stack is not None
        assert (await c.post("/v1/completions/", json={"prompt": [1]})).status_code == 307
        chat = await c.post("/v1/chat/completions", json={"messages": "nope"})
        assert chat.status_code == 422 and chat.json()["detail"][0]["loc"][0] == "body"
        assert (await c.get("/v1/status")).json()["backends"][0]["name"] == "f0"


async def test_user_middleware_turns_the_fast_path_off(tmp_path: Path) -> None:
    app = await make_app(tmp_path)
    seen: list[str] = []

    async def spy(request, call_next):  # noqa: ANN001, ANN202
        seen.append(request.url.path)
        return await call_next(request)

    app.add_middleware(BaseHTTPMiddleware, dispatch=spy)
    assert (await post(app, {"prompt": [1]}, fast=True)).status_code == 200
    assert seen == ["/v1/completions"]
