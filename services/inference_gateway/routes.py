"""HTTP routes of the gateway: an OpenAI-compatible proxy in front of the backends.

``POST /v1/completions`` and ``POST /v1/chat/completions`` answer in vLLM's shapes, always
with token ids (``choices[].token_ids``, ``prompt_token_ids``) and the ``policy_version``.
A call with an ``X-Temper-Episode`` header is attributed to that episode: its token-level
trace is recorded, its routing is sticky, and (chat) its conversation is extended
token-wise across turns. ``GET /v1/traces/{episode}`` reads the trace back. The routes read
the :class:`Inference` from ``app.state.inference``.

``/agent/<episode>/v1/...`` is each agent episode's own base URL (``add_agent_routes``,
``agents.py``): calls with the episode's key, recorded durably before they are answered.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import pydantic_core
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from services.inference_gateway.agents import AgentProxy, KeyRefused, OverBudget, Unavailable
from services.inference_gateway.backends import GenerateRequest
from services.inference_gateway.chat import (
    BadRequest,
    ChatAnswer,
    completion,
    read_tool_calls,
    refused_fields,
    stream,
)
from services.inference_gateway.cpu_server.runner import GenOutput
from services.inference_gateway.cpu_server.schemas import VERSION_HEADER, CompletionBody, completion_response
from services.inference_gateway.inference import Inference
from services.inference_gateway.router import RequestFailed
from services.inference_gateway.schemas import ChatBody, ReloadBody
from services.inference_gateway.traces import TraceEntry
from services.inference_gateway.weights import Waiting
from temper import metrics, problems
from temper.agent_traces import Credential
from temper.bus.errors import unavailable_dependency
from temper.events import PolicyUpdate, SamplingParams
from temper.policy import ChatTokenizer, assistant_stop_ids

EPISODE_HEADER = "X-Temper-Episode"


class GatewayApp(FastAPI):
    """FastAPI with a fast path for the proxy's hot routes.

    Under load the gateway does little but proxy ``POST /v1/completions``, and Starlette's
    middleware stack and router cost about as much CPU per request as the proxying itself.
    So a POST to a path in ``fast_routes`` goes straight to its handler (the same handler
    FastAPI would call, with ``request.app`` set); everything else, and every request to an
    app with user middleware or a root path, takes FastAPI's normal way. The fast path
    skips FastAPI's own (OpenTelemetry) instrumentation, which the gateway does not use;
    an unhandled error is answered 500 by the server instead of ``ServerErrorMiddleware``.
    """

    fast_routes: dict[str, Callable[[Request], Awaitable[Response]]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._fast_handler(scope)
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    def _fast_handler(self, scope: Scope) -> Callable[[Request], Awaitable[Response]] | None:
        if scope["type"] != "http" or scope["method"] != "POST" or self.user_middleware or self.root_path:
            return None
        if scope.get("root_path"):
            return None
        return getattr(self, "fast_routes", {}).get(scope["path"])


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic-core's encoder writes the same compact UTF-8 JSON as json.dumps(separators=(",", ":"),
    # ensure_ascii=False), several times faster for long id lists. (A non-finite float, which no
    # backend's JSON can carry, would be written as NaN/Infinity instead of failing.)
    return Response(
        pydantic_core.to_json(data), status_code=status, headers=headers, media_type="application/json"
    )


def _error(status: int, detail: str) -> Response:
    return _json({"detail": detail}, status)


def _chat_response(
    answer: ChatAnswer, tok: ChatTokenizer, body: ChatBody, headers: dict[str, str]
) -> Response:
    """The answer whole, or as server-sent events when the call asked for ``stream``."""
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        chunks = stream(answer, tok, logprobs=body.logprobs, include_usage=include_usage)
        return StreamingResponse(iter(list(chunks)), media_type="text/event-stream", headers=headers)
    return _json(completion(answer, tok, logprobs=body.logprobs), 200, headers)


async def get_inference(request: Request) -> Inference:
    return request.app.state.inference  # type: ignore[no-any-return]


InferenceDep = Annotated[Inference, Depends(get_inference)]
EpisodeHeader = Annotated[str | None, Header(alias=EPISODE_HEADER)]


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def add_health_routes(app: FastAPI) -> None:
    """``/health`` and ``/metrics`` of the proxy alone (without a runtime): ``/health`` is
    503 when every backend is down and lists those that are."""

    @app.get("/health")
    async def health(svc: InferenceDep) -> JSONResponse:
        snap = svc.router.snapshot()
        down = [b["name"] for b in snap if not b["healthy"]]
        ok = len(down) < len(snap)
        body = {"status": "ok" if ok else "down", "down": down}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        body, ctype = metrics.render_latest()
        return Response(body, media_type=ctype)


def add_proxy_routes(app: FastAPI) -> None:
    """The OpenAI-compatible routes; they use ``app.state.inference``."""

    @app.get("/v1/status")
    async def status(request: Request, svc: InferenceDep) -> dict[str, Any]:
        gateway = getattr(request.app.state, "gateway", None)
        return gateway.status() if gateway is not None else svc.status()

    @app.get("/v1/models")
    async def models(svc: InferenceDep) -> dict[str, Any]:
        name = svc.settings.model_name
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "temper",
                    "root": name,
                    "parent": None,
                    "permission": [],
                }
            ],
        }

    async def _run(svc: Inference, req: GenerateRequest) -> Any:
        try:
            return await svc.generate(req)
        except RequestFailed as exc:
            raise HTTPException(502, f"generation failed: {exc.reason}") from exc

    async def completions(request: Request) -> Response:
        """The hot proxy path, kept lean: no dependency injection or thread hop, one
        pydantic-core validation of the raw body, the response serialised once."""
        svc: Inference = request.app.state.inference
        try:
            body = CompletionBody.model_validate_json(await request.body())
        except ValidationError as exc:
            return _json({"detail": jsonable_encoder(exc.errors(include_url=False))}, 422)
        episode = request.headers.get(EPISODE_HEADER)
        if body.stream:
            return _error(400, "stream=true is not supported by the gateway")
        p = body.prompt
        if isinstance(p, str):
            prompt_ids = svc.tokenizer.encode(p)
        elif p and isinstance(p[0], int):  # validated lists are homogeneous: no per-token check
            prompt_ids = list(p)  # type: ignore[arg-type]
        else:
            return _error(400, "the gateway takes one prompt: a string or a list of token ids")
        if not prompt_ids:
            return _error(400, "prompt is empty")
        sampling = SamplingParams.model_construct(
            max_tokens=max(1, body.max_tokens),
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=_stop_list(body.stop),
            stop_token_ids=list(body.stop_token_ids or []),
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            res = await svc.generate(
                GenerateRequest(
                    prompt_ids,
                    sampling,
                    episode_id=episode,
                    request_id=rid,
                    ignore_eos=body.ignore_eos,
                    job_id=body.job_id,
                )
            )
        except RequestFailed as exc:
            return _error(502, f"generation failed: {exc.reason}")
        if episode:
            await svc.traces.record(
                TraceEntry(
                    episode_id=episode,
                    request_id=rid,
                    prompt_ids=res.prompt_ids,
                    token_ids=res.token_ids,
                    logprobs=res.logprobs,
                    policy_version=res.policy_version,
                    backend=res.backend,
                    finish_reason=res.finish_reason,
                    endpoint="completions",
                )
            )
        out = GenOutput(
            res.prompt_ids,
            res.token_ids,
            res.logprobs,
            res.text,
            res.finish_reason or "length",
            res.stop_reason,
            res.policy_version,
        )
        body.return_token_ids = True  # the gateway always shows token ids
        data = completion_response(
            [out], body, model=body.model or svc.settings.model_name, token_str=svc.tokenizer.token_str
        )
        data["id"] = rid
        return _json(data, 200, {VERSION_HEADER: str(res.policy_version)})

    app.router.add_route("/v1/completions", completions, methods=["POST"], name="completions")
    if isinstance(app, GatewayApp):
        app.fast_routes = {"/v1/completions": completions}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, svc: InferenceDep, episode: EpisodeHeader = None) -> Response:
        refused = refused_fields(body)
        if refused:
            raise HTTPException(400, refused)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt_ids = svc.sessions.prompt_ids(episode, messages, tools=body.tools)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        sampling = SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or 256,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=_stop_list(body.stop),
            stop_token_ids=assistant_stop_ids(svc.tokenizer),
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        res = await _run(svc, GenerateRequest(prompt_ids, sampling, episode_id=episode, request_id=rid))
        content, tool_calls = res.text, list[dict[str, Any]]()
        if body.tools and body.tool_choice != "none":
            parser = str(body.tool_parser or svc.settings.tool_parser)
            content, tool_calls = read_tool_calls(
                svc.tokenizer, res, parser, parallel=body.parallel_tool_calls is not False, tools=body.tools
            )
        answer = ChatAnswer(rid, body.model or svc.settings.model_name, res, content, tool_calls)
        if episode:
            svc.sessions.remember(
                episode, messages, res.prompt_ids, answer.message(), res.token_ids, body.tools
            )
            await svc.traces.record(
                TraceEntry(
                    episode_id=episode,
                    request_id=rid,
                    prompt_ids=res.prompt_ids,
                    token_ids=res.token_ids,
                    logprobs=res.logprobs,
                    policy_version=res.policy_version,
                    backend=res.backend,
                    finish_reason=res.finish_reason,
                    endpoint="chat.completions",
                    messages=messages,
                )
            )
        return _chat_response(answer, svc.tokenizer, body, {VERSION_HEADER: str(res.policy_version)})

    @app.get("/v1/traces/{episode_id}")
    async def traces(episode_id: str, svc: InferenceDep) -> dict[str, Any]:
        return {"episode_id": episode_id, "calls": [e.to_dict() for e in await svc.traces.get(episode_id)]}

    @app.post("/v1/policy/reload")
    async def reload(body: ReloadBody, svc: InferenceDep) -> dict[str, Any]:
        """Operator/test hook; in production ``policy.updates`` drives the same code."""
        if not (body.checkpoint_key or body.path):
            raise HTTPException(400, "give checkpoint_key or path")
        update = PolicyUpdate(
            job_id=body.job_id,
            version=body.version,
            checkpoint_key=body.checkpoint_key or body.path or "",
            step=0,
        )
        try:
            times = await svc.apply_update(update, path=Path(body.path) if body.path else None)
        except Waiting as exc:
            raise HTTPException(409, str(exc)) from exc
        except RuntimeError as exc:
            raise HTTPException(502, str(exc)) from exc
        return {
            "job_id": body.job_id,
            "policy_version": svc.confirmed(body.job_id),
            "switch_ms": {k: v * 1000 for k, v in times.items()},
        }


def _openai_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error as OpenAI's API writes one (clients show ``error.message``), with ``detail``
    as the gateway's other routes have it."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
    body = {
        "error": {"message": message, "type": kind.get(status, "api_error"), "param": None, "code": status},
        "detail": message,
    }
    return _json(body, status, headers)


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = _openai_error(status, message, headers)


def add_agent_routes(app: FastAPI) -> None:
    """Each agent episode's own OpenAI-compatible base URL, ``/agent/<episode>/v1``
    (``agents.py``; docs/agents.md): chat completions (with tools, ``stream``) and the model
    list, each call taken only with the episode's key. Errors come in OpenAI's shape."""

    async def authorized(request: Request, episode_id: str) -> tuple[AgentProxy, Credential]:
        agents = getattr(getattr(request.app.state, "gateway", None), "agents", None)
        if agents is None:
            raise _Refused(503, "this gateway serves no agent episodes (it runs without a runtime)")
        try:
            return agents, await agents.authorize(episode_id, request.headers.get("authorization"))
        except KeyRefused as exc:
            raise _Refused(exc.status, exc.reason) from exc
        except Unavailable as exc:
            raise _Refused(503, str(exc)) from exc

    async def answer(request: Request, episode_id: str) -> Response:
        agents, cred = await authorized(request, episode_id)
        try:
            body = ChatBody.model_validate_json(await request.body())
        except ValidationError as exc:
            raise _Refused(400, problems.message(exc.errors()[0])) from exc
        try:
            answer, job, sampling = await agents.chat(cred, body)
        except BadRequest as exc:
            raise _Refused(400, str(exc)) from exc
        except OverBudget as exc:  # a retry cannot help: the client is told not to
            raise _Refused(429, str(exc), {"x-should-retry": "false"}) from exc
        except RequestFailed as exc:
            raise _Refused(502, f"generation failed: {exc.reason}") from exc
        except Exception as exc:
            outage = unavailable_dependency(exc)
            if outage is None:
                raise
            raise _Refused(503, f"the call was not answered: the {outage} is unavailable") from exc
        headers = {
            VERSION_HEADER: str(answer.result.policy_version),
            "X-Temper-Sampling": (
                f"temperature={sampling.temperature}; top_p={sampling.top_p}; max_tokens={sampling.max_tokens}"
            ),
        }
        return _chat_response(answer, job.tokenizer, body, headers)

    @app.post("/agent/{episode_id}/v1/chat/completions")
    async def agent_chat(episode_id: str, request: Request) -> Response:
        try:
            return await answer(request, episode_id)
        except _Refused as exc:
            return exc.response

    @app.get("/agent/{episode_id}/v1/models")
    async def agent_models(episode_id: str, request: Request) -> Response:
        try:
            agents, cred = await authorized(request, episode_id)
        except _Refused as exc:
            return exc.response
        name = (await agents.job(cred.job_id)).name
        model = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "temper"}
        return _json({"object": "list", "data": [model]})
