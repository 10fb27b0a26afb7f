from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from services.inference_gateway.app import proxy_app
from services.inference_gateway.inference import Inference
from temper.events import InferenceRequest, PolicyUpdate, SamplingParams
from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint
from temper.settings.inference import BackendSpec, InferenceSettings
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(60)
TOK = default_tokenizer()
FIXTURES = Path(__file__).parent / "fixtures"


def make_service(cpu_servers, tmp_path: Path) -> Inference:  # noqa: ANN001
    cfg = InferenceSettings(
        backends=[BackendSpec(name=f"e{i}", url=s.url) for i, s in enumerate(cpu_servers)],
        checkpoint_cache_dir=str(tmp_path / "cache"),
        retry_backoff_s=0.001,
        health_interval_s=0.5,
    )
    return Inference(cfg, store=LocalStore(tmp_path / "objects"))


async def test_handle_turns_a_request_message_into_a_result_message(cpu_servers, tmp_path) -> None:  # noqa: ANN001
    svc = make_service(cpu_servers, tmp_path)
    await svc.start()
    try:
        prompt = encode_chat(TOK, [{"role": "user", "content": "hi"}])
        msg = InferenceRequest(
            job_id="j",
            episode_id="ep",
            turn=2,
            attempt=1,
            model="temper-policy",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=5, seed=3),
        )
        assert svc.has_capacity()
        res = await svc.handle(msg)
        assert res.error is None and res.backend in ("e0", "e1")
        assert (res.job_id, res.episode_id, res.turn, res.attempt) == ("j", "ep", 2, 1)
        assert 1 <= len(res.token_ids) == len(res.logprobs) <= 5 and res.policy_version == 0
        for s in cpu_servers:
            s.stop()
        failed = await svc.handle(msg)
        assert failed.error and failed.token_ids == []
    finally:
        await svc.stop()


async def test_a_full_weights_update_takes_one_server_for_its_job(cpu_servers, tmp_path) -> None:  # noqa: ANN001
    """A job's full weights go on one server, which then serves that job only; the other
    server keeps serving every other job's version 0."""
    svc = make_service(cpu_servers, tmp_path)
    ckpt = save_checkpoint(create_model(seed=5), tmp_path / "ckpt")
    await svc.store.put(
        "tenants/t/jobs/j/checkpoints/v1/model.safetensors", (ckpt / "model.safetensors").read_bytes()
    )
    await svc.start()
    try:
        prompt = encode_chat(TOK, [{"role": "user", "content": "v"}])
        msg = InferenceRequest(
            job_id="j",
            model="temper-policy",
            prompt_ids=prompt,
            episode_id="e",
            sampling=SamplingParams(max_tokens=6, seed=1, temperature=0),
        )
        other = msg.model_copy(update={"job_id": "k", "episode_id": "e-k"})
        before = await svc.handle(msg)
        inflight = [asyncio.create_task(svc.handle(msg)) for _ in range(6)]
        times = await svc.apply_update(
            PolicyUpdate(job_id="j", version=1, checkpoint_key="tenants/t/jobs/j/checkpoints/v1", step=10)
        )
        done = await asyncio.gather(*inflight)
        after = await svc.handle(msg)
        (held,) = times
        assert times[held] > 0
        assert all(r.error is None and r.policy_version in (0, 1) for r in done)
        assert (before.policy_version, after.policy_version) == (0, 1) and after.logprobs != before.logprobs
        assert after.backend == held
        assert (
            await svc.apply_update(PolicyUpdate(job_id="j", version=1, checkpoint_key="x", step=10)) == {}
        )  # idempotent
        assert [s.runner.holding().owner for s in cpu_servers] == [
            "j" if f"e{i}" == held else None for i in range(2)
        ]
        for _ in range(4):  # another job never lands on job j's weights
            k = await svc.handle(other)
            assert (k.error, k.policy_version) == (None, 0) and k.backend != held
            assert k.logprobs == before.logprobs
    finally:
        await svc.stop()


@pytest.fixture
async def gateway(cpu_servers, tmp_path):  # noqa: ANN001, ANN201
    svc = make_service(cpu_servers, tmp_path)
    app = proxy_app(svc)
    await svc.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c, svc
    await svc.stop()


async def test_completions_proxy_records_the_episode_trace(gateway) -> None:  # noqa: ANN001
    c, svc = gateway
    prompt = encode_chat(TOK, [{"role": "user", "content": "trace me"}])
    r = await c.post(
        "/v1/completions",
        headers={"X-Temper-Episode": "ep-7"},
        json={"prompt": prompt, "max_tokens": 4, "seed": 2, "logprobs": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["prompt_token_ids"] == prompt and len(ch["token_ids"]) == 4
    assert r.headers["X-Temper-Policy-Version"] == "0"
    calls = (await c.get("/v1/traces/ep-7")).json()["calls"]
    assert len(calls) == 1
    assert calls[0]["prompt_ids"] == prompt and calls[0]["token_ids"] == ch["token_ids"]
    assert calls[0]["logprobs"] == ch["logprobs"]["token_logprobs"] and calls[0]["policy_version"] == 0
    assert (await c.get("/health")).status_code == 200
    assert b"temper_inference_backend_healthy" in (await c.get("/metrics")).content


async def test_chat_proxy_extends_the_conversation_token_wise(gateway) -> None:  # noqa: ANN001
    c, svc = gateway
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "ls"}]
    h = {"X-Temper-Episode": "ep-chat"}
    r1 = await c.post("/v1/chat/completions", headers=h, json={"messages": msgs, "max_tokens": 6, "seed": 1})
    assert r1.status_code == 200, r1.text
    d1 = r1.json()
    fixture_keys = set(json.loads((FIXTURES / "vllm_0.10.2_chat_token_ids.json").read_text())["response"])
    assert fixture_keys <= set(d1) and set(d1["choices"][0]) >= {"message", "token_ids", "finish_reason"}
    reply = d1["choices"][0]["message"]["content"]
    msgs2 = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "cat x"}]
    r2 = await c.post("/v1/chat/completions", headers=h, json={"messages": msgs2, "max_tokens": 6, "seed": 1})
    d2 = r2.json()
    first_ids = d1["prompt_token_ids"] + d1["choices"][0]["token_ids"]
    assert (
        d2["prompt_token_ids"][: len(first_ids)] == first_ids
    )  # the sampled ids themselves, not re-encoded text
    assert svc.sessions.extended == 1
    calls = (await c.get("/v1/traces/ep-chat")).json()["calls"]
    assert [x["endpoint"] for x in calls] == ["chat.completions", "chat.completions"]
    assert len({x["backend"] for x in calls}) == 1  # sticky


async def test_gateway_health_names_down_backends(gateway, cpu_servers) -> None:  # noqa: ANN001
    c, svc = gateway
    for s in cpu_servers:
        s.stop()
    await svc.router.check_health()
    r = await c.get("/health")
    assert r.status_code == 503 and set(r.json()["down"]) == {"e0", "e1"}
    r2 = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r2.status_code == 502 and "no backend available" in r2.text
