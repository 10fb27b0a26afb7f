"""HTTP routes of the CPU model server: the subset of vLLM's OpenAI-compatible server Temper uses.

- ``POST /v1/completions``: ``prompt`` as text, a list of token ids, or a list of either;
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``,
  ``ignore_eos``, ``logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``. The
  response has vLLM's shape (``choices[].token_ids``/``prompt_token_ids`` as in vLLM >= 0.10.2)
  plus ``policy_version`` at the top level and in the ``X-Temper-Policy-Version`` header.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
- ``POST /v1/load_weights`` ``{"version", "path"?, "key"?, "job_id"?}``: load a job's version
  between batches (a LoRA adapter, or full weights in place of the base); a local ``path``
  wins when it exists here, else ``key`` is fetched from the object store.
- ``POST /v1/load_base`` ``{"name", "path"?, "key"?}``: serve another base model;
  ``POST /v1/release`` ``{"job_id"}``: a job ended, its adapter or full weights go.
  Both, and a completion of a job this server does not hold now, answer 409 while
  another job's full weights are loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse

from services.inference_gateway.checkpoints import fetch_checkpoint, fetch_model
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import GenRequest, NotServed, SamplingParams
from services.inference_gateway.cpu_server.schemas import (
    VERSION_HEADER,
    CompletionBody,
    LoadBaseBody,
    LoadWeightsBody,
    ReleaseBody,
    completion_response,
)
from temper import metrics
from temper.registry import CorruptVersion
from temper.storage import NotFound, ObjectStore


def _prompts(body: CompletionBody, encode: Callable[[str], list[int]]) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [encode(p)]
    if not p:
        raise HTTPException(400, "prompt is empty")
    if all(isinstance(x, int) for x in p):
        return [[x for x in p if isinstance(x, int)]]
    # validated lists are homogeneous: no ints here, the filter only narrows the type
    return [encode(x) if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]


def add_routes(
    app: FastAPI,
    scheduler: BatchScheduler,
    *,
    model_name: str,
    store: ObjectStore | None,
    cache_dir: str | Path,
) -> None:
    runner = scheduler.runner
    backend = "cpu_server"  # the metrics label of this server's requests

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Up, and what it serves (:class:`Holding`): the gateway's view of this server."""
        return {"status": "ok", **runner.holding().to_dict()}

    @app.get("/metrics")
    async def prom() -> Response:
        body, ctype = metrics.render_latest()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "temper",
                    "root": model_name,
                    "parent": None,
                    "max_model_len": runner.max_len,
                    "permission": [],
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> JSONResponse:
        if body.stream:
            raise HTTPException(400, "stream=true is not supported by the CPU model server")
        prompts = _prompts(body, runner.tok.encode)
        for p in prompts:
            if not p:
                raise HTTPException(400, "prompt is empty")
            if min(p) < 0 or max(p) >= runner.tok.vocab_size:
                raise HTTPException(400, f"prompt token ids must be in [0, {runner.tok.vocab_size})")
            if len(p) >= runner.max_len:
                raise HTTPException(400, f"prompt of {len(p)} tokens exceeds max_model_len {runner.max_len}")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
        )
        t0 = time.perf_counter()
        metrics.INFERENCE_INFLIGHT.labels(backend).inc()
        try:
            outs = list(
                await asyncio.gather(
                    *(
                        scheduler.submit(
                            GenRequest(p, params, job_id=body.job_id, partial_rollout=body.partial_rollout)
                        )
                        for p in prompts
                    )
                )
            )
        except NotServed as exc:
            metrics.INFERENCE_REQUESTS.labels(backend, "error").inc()
            raise HTTPException(409, str(exc)) from exc
        except Exception:
            metrics.INFERENCE_REQUESTS.labels(backend, "error").inc()
            raise
        finally:
            metrics.INFERENCE_INFLIGHT.labels(backend).dec()
        metrics.INFERENCE_SECONDS.labels(backend).observe(time.perf_counter() - t0)
        metrics.INFERENCE_REQUESTS.labels(backend, "ok").inc()
        data = completion_response(outs, body, model=body.model or model_name, token_str=runner.tok.token_str)
        return JSONResponse(data, headers={VERSION_HEADER: str(data["policy_version"])})

    @app.post("/v1/load_weights")
    async def load(body: LoadWeightsBody) -> dict[str, Any]:
        """Load a job's version between batches: 409 while another job holds this server."""
        path = Path(body.path) if body.path else None
        if path is None or not path.exists():
            if not body.key:
                raise HTTPException(
                    404 if path else 400, f"no checkpoint at {path}" if path else "give path or key"
                )
            if store is None:
                raise HTTPException(400, "this server has no object store to resolve keys")
            try:
                path = await fetch_checkpoint(store, body.key, cache_dir, body.version)
            except NotFound as exc:
                raise HTTPException(404, f"no checkpoint at key {body.key}") from exc
            except CorruptVersion as exc:
                raise HTTPException(422, str(exc)) from exc
        try:
            seconds = await scheduler.reload(path, body.version, body.job_id)
        except NotServed as exc:
            raise HTTPException(409, str(exc)) from exc
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        metrics.WEIGHT_SWITCH_SECONDS.observe(seconds)
        app.state.last_switch_s = seconds
        return {**runner.holding().to_dict(), "switch_ms": seconds * 1000}

    @app.post("/v1/load_base")
    async def load_base(body: LoadBaseBody) -> dict[str, Any]:
        """Serve another base model (no job holds this server and no adapter is on it);
        neither path nor key: the weights it started with."""
        directory = None
        if body.path or body.key:
            try:
                directory = await fetch_model(store, body.path or body.key or "", cache_dir)
            except NotFound as exc:
                raise HTTPException(404, str(exc)) from exc
        try:
            seconds = await scheduler.load_base(directory, body.name)
        except NotServed as exc:
            raise HTTPException(409, str(exc)) from exc
        except (OSError, ValueError) as exc:
            raise HTTPException(400, f"cannot load {body.name}: {exc}") from exc
        return {**runner.holding().to_dict(), "switch_ms": seconds * 1000}

    @app.post("/v1/release")
    async def release(body: ReleaseBody) -> dict[str, Any]:
        """A job ended: its adapter goes, or its full weights give way to the base again."""
        seconds = await scheduler.release(body.job_id)
        return {**runner.holding().to_dict(), "switch_ms": seconds * 1000}
