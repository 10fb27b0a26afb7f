"""The Gateway component on a Runtime with the in-process bus: requests in, results out,
failures answered, policy updates applied (and coalesced), /health naming the backends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from services.inference_gateway.app import create_app
from services.inference_gateway.component import Gateway
from services.inference_gateway.inference import Inference
from temper.bus import Record
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate, SamplingParams, Topics, decode
from temper.policy import create_model, default_tokenizer, encode_chat, save_weights
from temper.runtime import Runtime
from temper.settings import BusKind, BusSettings, Settings, StorageKind, StorageSettings
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings

pytestmark = pytest.mark.timeout(60)
TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "hello"}])


def settings(tmp: Path, **inference: object) -> Settings:
    return Settings(
        bus=BusSettings(kind=BusKind.inprocess, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp / "objects"),
        data_dir=tmp,
        inference=InferenceSettings(
            checkpoint_cache_dir=str(tmp / "cache"), retry_backoff_s=0.001, **inference
        ),
    )


async def started(tmp: Path, **inference: object) -> tuple[Runtime, Gateway, list[InferenceResult]]:
    rt = Runtime(settings(tmp, **inference), service="inference-gateway", needs_db=False)
    await rt.start()
    gw = Gateway(rt)
    await gw.start()
    results: list[InferenceResult] = []

    async def collect(record: Record) -> None:
        results.append(decode(record.value))  # type: ignore[arg-type]

    assert rt.bus is not None
    await rt.bus.subscribe([Topics.INFERENCE_RESULTS], "test-results", collect)
    return rt, gw, results


async def wait_until(pred, limit_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + limit_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def request(episode: str, **kw: object) -> InferenceRequest:
    base: dict[str, object] = dict(
        job_id="job",
        episode_id=episode,
        turn=1,
        attempt=2,
        model="temper-policy",
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=4, seed=7),
    )
    base.update(kw)
    return InferenceRequest(**base)  # type: ignore[arg-type]


async def test_embedded_gateway_without_backends_serves_from_a_local_engine(tmp_path) -> None:  # noqa: ANN001
    rt, gw, results = await started(tmp_path)
    try:
        assert [s.backend.spec.kind for s in gw.inference.router.slots.values()] == [BackendKind.local]
        assert (await rt.health())["backends"] == "ok"
        await rt.bus.send_message(Topics.INFERENCE_REQUESTS, request("ep-a"))
        await rt.bus.send_message(Topics.INFERENCE_REQUESTS, request("ep-bad", prompt_ids=[99999]))
        await wait_until(lambda: len(results) == 2)
        by_ep = {r.episode_id: r for r in results}
        ok, bad = by_ep["ep-a"], by_ep["ep-bad"]
        assert (ok.job_id, ok.turn, ok.attempt, ok.error) == ("job", 1, 2, None)
        assert (
            1 <= len(ok.token_ids) == len(ok.logprobs) <= 4
            and ok.policy_version == 0
            and ok.backend == "local-0"
        )
        assert (
            bad.error
            and "token ids" in bad.error
            and bad.token_ids == []
            and (bad.turn, bad.attempt) == (1, 2)
        )
        # a redelivered request is generated again: same envelope, same tokens (seeded)
        await rt.bus.send_message(Topics.INFERENCE_REQUESTS, request("ep-a"))
        await wait_until(lambda: len(results) == 3)
        again = results[-1]
        assert (again.key(), again.turn, again.attempt, again.token_ids) == (ok.key(), 1, 2, ok.token_ids)
    finally:
        await gw.stop()
        await rt.stop()


async def test_policy_updates_are_applied_newest_first_and_tag_results(tmp_path) -> None:  # noqa: ANN001
    rt, gw, results = await started(tmp_path, health_interval_s=0.5)
    try:
        store = rt.store
        for v, seed in ((1, 11), (2, 12)):
            path = save_weights(create_model(seed=seed), tmp_path / f"w{v}.safetensors")
            await store.put(f"tenants/t/jobs/job/checkpoints/v{v}.safetensors", path.read_bytes())
        for v in (1, 2):
            await rt.bus.send_message(
                Topics.POLICY_UPDATES,
                PolicyUpdate(
                    job_id="job",
                    version=v,
                    checkpoint_key=f"tenants/t/jobs/job/checkpoints/v{v}.safetensors",
                    step=v,
                ),
            )
        await wait_until(lambda: gw.inference.confirmed("job") == 2)
        assert gw.updates.update_errors == 0 and gw.updates.updates_applied in (1, 2)
        await rt.bus.send_message(Topics.INFERENCE_REQUESTS, request("ep-v"))
        await wait_until(lambda: len(results) == 1)
        assert results[0].policy_version == 2 and results[0].error is None
        # a missing checkpoint is logged and counted, the gateway keeps serving version 2
        gw.updates.retries = 1
        await rt.bus.send_message(
            Topics.POLICY_UPDATES,
            PolicyUpdate(
                job_id="job",
                version=3,
                checkpoint_key="tenants/t/jobs/job/checkpoints/missing.safetensors",
                step=3,
            ),
        )
        await wait_until(lambda: gw.updates.update_errors == 1)
        assert gw.inference.confirmed("job") == 2
        # it stays wanted and the watch tries it again: once the checkpoint can be read (an
        # object store back from refusing), version 3 is served. Dropping it left a job whose
        # next iteration waits on version 3 stopped for good (a reduced-chaos run).
        assert gw.updates.wanted["job"].version == 3 and "job" in gw.updates.retry_at
        path = save_weights(create_model(seed=13), tmp_path / "w3.safetensors")
        await store.put("tenants/t/jobs/job/checkpoints/missing.safetensors", path.read_bytes())
        await wait_until(lambda: gw.inference.confirmed("job") == 3)
        assert gw.updates.retry_at == {} and gw.updates.update_errors == 1
    finally:
        await gw.stop()
        await rt.stop()


async def test_health_is_503_when_no_backend_is_configured(tmp_path) -> None:  # noqa: ANN001
    s = settings(tmp_path)
    app = create_app(s, inference=Inference(s.inference, backends=[]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["down"] == ["backends"], r.text
            assert "none configured" in r.json()["components"]["backends"]
            assert r.json()["components"]["bus"] == "ok"
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 502 and "no backend configured" in r.text
        assert app.state.gateway.requests.paused  # nothing can serve: requests stay on the bus


async def test_local_backend_answers_the_openai_proxy(tmp_path) -> None:  # noqa: ANN001
    app = create_app(settings(tmp_path, backends=[BackendSpec(name="l0", kind=BackendKind.local, seed=3)]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 3, "seed": 1},
                headers={"X-Temper-Episode": "ep-http"},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["token_ids"] and body["policy_version"] == 0
            status = (await c.get("/v1/status")).json()
            assert status["backends"][0]["name"] == "l0" and status["requests_group"] == "inference-gateway"


async def test_a_gateway_that_starts_serves_the_running_jobs_current_version(tmp_path) -> None:  # noqa: ANN001
    """A (re)started gateway loads the newest published version of the running jobs from
    the database before its first request, not version 0 or what its policy group replays."""
    from temper.db import Job, PolicyVersion, Tenant
    from temper.db.migrate import upgrade
    from temper.settings import DatabaseSettings

    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    rt = Runtime(
        settings(tmp_path).model_copy(update={"db": DatabaseSettings(url=url)}), service="temper-run"
    )
    await rt.start()
    gw = Gateway(rt)
    try:
        assert rt.db is not None and rt.store is not None and rt.bus is not None
        async with rt.db.session() as s:
            s.add(Tenant(id="t", name="T"))
        async with rt.db.session() as s:
            s.add(Job(id="done", tenant_id="t", name="old", spec={}, state="completed", policy_version=9))
            s.add(Job(id="job", tenant_id="t", name="now", spec={}, state="running", policy_version=2))
        for job, v in (("done", 9), ("job", 1), ("job", 2)):
            key = f"tenants/t/jobs/{job}/checkpoints/v{v}.safetensors"
            path = save_weights(create_model(seed=v), tmp_path / f"{job}-{v}.safetensors")
            await rt.store.put(key, path.read_bytes())
            async with rt.db.session() as s:
                s.add(PolicyVersion(job_id=job, version=v, checkpoint_key=key, step=v))
        await gw.start()
        assert gw.inference.confirmed("job") == 2, "the running job's newest version, not a finished job's"
        assert gw.inference.table.holders_of("done") == []
        async with rt.db.session() as s:  # confirmed by every backend serving the job, on its row
            rows = {v.version: v for v in (await s.execute(select(PolicyVersion))).scalars()}
        assert rows[2].served_by == ["local-0"] and rows[2].served_at is not None
        assert rows[1].served_at is None and rows[9].served_at is None
        results: list[InferenceResult] = []

        async def collect(record: Record) -> None:
            results.append(decode(record.value))  # type: ignore[arg-type]

        await rt.bus.subscribe([Topics.INFERENCE_RESULTS], "test-results", collect)
        await rt.bus.send_message(Topics.INFERENCE_REQUESTS, request("ep-restart"))
        await wait_until(lambda: len(results) == 1)
        assert results[0].policy_version == 2 and results[0].error is None
    finally:
        await gw.stop()
        await rt.stop()
