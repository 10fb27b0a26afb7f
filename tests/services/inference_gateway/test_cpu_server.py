from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from services.inference_gateway.cpu_server.app import create_app
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import (
    GenRequest,
    ModelRunner,
    SamplingParams,
)
from temper.policy import (
    create_model,
    default_tokenizer,
    encode_chat,
    pad_batch,
    save_checkpoint,
    token_logprobs,
)

pytestmark = pytest.mark.timeout(60)

TOK = default_tokenizer()


@pytest.fixture(scope="module")
def engine() -> ModelRunner:
    return ModelRunner(create_model(seed=0), TOK)


def req(text: str, **kw) -> GenRequest:  # noqa: ANN003
    kw.setdefault("ignore_eos", True)
    return GenRequest(encode_chat(TOK, [{"role": "user", "content": text}]), SamplingParams(**kw))


def test_same_seed_same_tokens_alone_and_inside_a_batch(engine: ModelRunner) -> None:
    target = req("hello", max_tokens=12, seed=42, temperature=1.0)
    alone = engine.generate([target])[0]
    again = engine.generate([target])[0]
    others = [req("x" * n, max_tokens=n % 7 + 3, seed=n) for n in (1, 9, 30)]
    batched = engine.generate([others[0], target, *others[1:]])[1]
    assert alone.token_ids == again.token_ids == batched.token_ids
    assert len(alone.token_ids) == 12 and alone.finish_reason == "length"
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    other_seed = engine.generate([req("hello", max_tokens=12, seed=43)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_a_group_sharing_a_prompt_is_prefilled_once_and_samples_as_each_would_alone(
    engine: ModelRunner, monkeypatch
) -> None:
    import services.inference_gateway.cpu_server.decoding as decoding

    group = [req("the same task", max_tokens=10, seed=s, temperature=1.0) for s in (1, 2, 3, 4)]
    other = req("another task, longer", max_tokens=8, seed=9, temperature=1.0)
    alone = [engine.generate([r])[0] for r in (*group, other)]
    prefilled: list[int] = []
    plain_forward = decoding.forward

    def counting(model, ids, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        if kw.get("cache") is None:
            prefilled.append(ids.shape[0])
        return plain_forward(model, ids, *args, **kw)

    monkeypatch.setattr(decoding, "forward", counting)
    together = engine.generate([group[0], group[1], other, group[2], group[3]])
    assert prefilled == [2], "one prefill row per distinct prompt"
    for got, want in zip(together, [alone[0], alone[1], alone[4], alone[2], alone[3]], strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert len({tuple(o.token_ids) for o in together[:2] + together[3:]}) > 1, "the rows sampled apart"


def test_sampled_logprobs_equal_a_forward_pass(engine: ModelRunner) -> None:
    outs = engine.generate(
        [req("abc", max_tokens=10, seed=1), req("a much longer prompt", max_tokens=10, seed=2)]
    )
    seqs = [o.prompt_ids + o.token_ids for o in outs]
    ids, mask = pad_batch(seqs, TOK.pad_id)
    with torch.no_grad():
        lp = token_logprobs(engine.model, ids, mask)
    for row, o in enumerate(outs):
        start = len(o.prompt_ids)
        recomputed = lp[row, start : start + len(o.token_ids)].tolist()
        assert recomputed == pytest.approx(o.logprobs, abs=1e-4)


def test_greedy_and_tiny_top_p_agree(engine: ModelRunner) -> None:
    greedy = engine.generate([req("q", max_tokens=8, temperature=0.0)])[0]
    nucleus = engine.generate([req("q", max_tokens=8, temperature=1.0, top_p=1e-6, seed=5)])[0]
    assert greedy.token_ids == nucleus.token_ids


def test_stop_token_ids_and_eos(engine: ModelRunner) -> None:
    first = engine.generate([req("s", max_tokens=8, seed=3)])[0]
    stop_at = first.token_ids[2]
    out = engine.generate([req("s", max_tokens=8, seed=3, stop_token_ids=[stop_at])])[0]
    k = first.token_ids.index(stop_at)
    assert out.token_ids == first.token_ids[: k + 1]  # the stop token is kept, as vLLM does
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_stop_strings_cut_the_text(engine: ModelRunner) -> None:
    first = engine.generate([req("t", max_tokens=32, seed=11)])[0]
    printable = [i for i, t in enumerate(first.token_ids) if 32 <= t < 127]
    assert printable, "the random model produced no ASCII token; pick another seed"
    i = printable[0]
    stop = chr(first.token_ids[i])
    out = engine.generate([req("t", max_tokens=32, seed=11, stop=[stop])])[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert out.token_ids == first.token_ids[: len(out.token_ids)]


def test_max_tokens_zero_returns_nothing(engine: ModelRunner) -> None:
    out = engine.generate([req("z", max_tokens=0)])[0]
    assert out.token_ids == [] and out.finish_reason == "length"


async def test_scheduler_batches_concurrent_requests(engine: ModelRunner) -> None:
    sched = BatchScheduler(engine, max_batch=8, window_ms=20)
    await sched.start()
    try:
        outs = await asyncio.gather(*(sched.submit(req(f"r{i}", max_tokens=4, seed=i)) for i in range(6)))
    finally:
        await sched.stop()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert sched.batches < 6


async def test_a_request_joins_the_running_batch_at_its_next_token(engine: ModelRunner, monkeypatch) -> None:
    """Continuous batching: a request that arrives while a long generation decodes starts at
    the next token beside it (it does not wait for the batch to end) and leaves as soon as it
    is done; each row's tokens and logprobs are those it gets alone."""
    long_req = req("a long one", max_tokens=160, seed=1)
    short_reqs = [
        req("short", max_tokens=6, seed=7),
        req("a rather longer prompt than the others", max_tokens=9, seed=8),
    ]
    alone = [engine.generate([r])[0] for r in (long_req, *short_reqs)]
    advance, widths = engine.advance, []
    decoding = threading.Event()  # the long one has decoded 20 tokens

    def watched(batch):  # noqa: ANN001, ANN202
        widths.append(len(batch.rows))
        if len(widths) >= 20:
            decoding.set()
        return advance(batch)

    monkeypatch.setattr(engine, "advance", watched)
    sched = BatchScheduler(engine, max_batch=8, window_ms=1)
    await sched.start()
    try:
        long_call = asyncio.create_task(sched.submit(long_req))
        assert await asyncio.to_thread(decoding.wait, 60), "the long one never decoded"
        shorts = await asyncio.gather(*(sched.submit(r) for r in short_reqs))
        assert not long_call.done(), "the short requests ended while the long one still decoded"
        long_out = await long_call
    finally:
        await sched.stop()
    assert max(widths) == 3 and widths[0] == 1 and widths[-1] == 1, "they joined, then left"
    assert sched.batches in (2, 3)  # the long one's prefill, then the joiners' (one or two)
    for out, want in zip([long_out, *shorts], alone, strict=True):
        assert out.token_ids == want.token_ids
        assert out.logprobs == pytest.approx(want.logprobs, abs=1e-4)


async def test_stop_abandons_a_generation_in_progress_at_its_next_token(
    engine: ModelRunner, monkeypatch
) -> None:
    """A thread cannot be cancelled: without this a long generation held the gateway's exit
    (the runner's thread decodes to the model's length) long past SIGTERM."""

    from services.inference_gateway.cpu_server.runner import Stopped

    advance, running = engine.advance, threading.Event()
    tokens: list[int] = []
    finished: list[bool] = []

    def watched(batch):  # noqa: ANN001, ANN202
        running.set()
        out = advance(batch)
        tokens.append(1)
        finished.extend(True for _ in out)
        return out

    monkeypatch.setattr(engine, "advance", watched)
    budget = engine.max_len - 40  # as long as the model allows: seconds of decoding
    sched = BatchScheduler(engine, max_batch=2, window_ms=1)
    await sched.start()
    call = asyncio.create_task(sched.submit(req("go on", max_tokens=budget, seed=1)))
    assert await asyncio.to_thread(running.wait, 20), "the generation never started"
    await asyncio.sleep(0.2)  # inside the decode loop
    at_stop = len(tokens)
    await asyncio.wait_for(sched.stop(), 5)  # the runner's thread has ended
    with pytest.raises(Stopped):
        await asyncio.wait_for(call, 5)
    assert not finished and len(tokens) <= at_stop + 1 < budget, "cut short at the next token, not finished"
    # started again, it serves as before
    await sched.start()
    try:
        out = await sched.submit(req("again", max_tokens=3, seed=2))
    finally:
        await sched.stop()
    assert len(out.token_ids) == 3


@pytest.fixture
async def client(engine: ModelRunner):  # noqa: ANN201
    sched = BatchScheduler(engine, max_batch=8, window_ms=2)
    app = create_app(sched, model_name="tiny")
    await sched.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        yield c
    await sched.stop()


async def test_http_completions_shape(client: httpx.AsyncClient) -> None:
    prompt = encode_chat(TOK, [{"role": "user", "content": "hi"}])
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 5,
            "seed": 7,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["model"] == "tiny"
    assert r.headers["X-Temper-Policy-Version"] == "0" and data["policy_version"] == 0
    ch = data["choices"][0]
    assert ch["prompt_token_ids"] == prompt and len(ch["token_ids"]) == 5
    assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert len(ch["logprobs"]["token_logprobs"]) == 5 and ch["logprobs"]["top_logprobs"] is None
    assert data["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
        "prompt_tokens_details": None,
    }
    # text prompt, no ids requested: vLLM's default shape
    r2 = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "seed": 1})
    assert r2.json()["choices"][0]["token_ids"] is None and r2.json()["choices"][0]["logprobs"] is None
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tiny"
    assert (await client.get("/health")).status_code == 200
    assert b"temper_inference_requests_total" in (await client.get("/metrics")).content


async def test_http_rejects_bad_prompts(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/completions", json={"prompt": [], "max_tokens": 2})).status_code == 400
    assert (
        await client.post("/v1/completions", json={"prompt": [99999], "max_tokens": 2})
    ).status_code == 400


async def test_weight_reload_bumps_version_and_loses_nothing(tmp_path) -> None:
    engine = ModelRunner(create_model(seed=0), TOK)
    sched = BatchScheduler(engine, max_batch=4, window_ms=1)
    app = create_app(sched)
    save_checkpoint(create_model(seed=99), tmp_path / "v1")
    body = {
        "prompt": encode_chat(TOK, [{"role": "user", "content": "w"}]),
        "max_tokens": 6,
        "seed": 3,
        "return_token_ids": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    await sched.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
            before = (await c.post("/v1/completions", json=body)).json()
            inflight = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(8)]
            await asyncio.sleep(0.01)
            r = await c.post("/v1/load_weights", json={"path": str(tmp_path / "v1"), "version": 1})
            assert r.status_code == 200, r.text
            assert (r.json()["owner"], r.json()["version"], r.json()["switch_ms"] > 0) == ("", 1, True)
            done = [x.json() for x in await asyncio.gather(*inflight)]
            after = (await c.post("/v1/completions", json=body)).json()
            missing = await c.post("/v1/load_weights", json={"path": str(tmp_path / "nope"), "version": 2})
    finally:
        await sched.stop()
    assert len(done) == 8 and all(d["policy_version"] in (0, 1) for d in done)
    for d in done:  # each finished on one version, with that version's tokens
        want = before if d["policy_version"] == 0 else after
        assert d["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert before["policy_version"] == 0 and after["policy_version"] == 1
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert missing.status_code == 404
