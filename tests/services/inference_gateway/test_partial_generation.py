"""Partial rollouts in the CPU engine (continuous batching): a row of a partial-rollout
request that runs when its job's next version waits to load is cut at its next token and
set aside, the version is loaded once no row runs, and the row goes on from its prefix on
the new weights. Every token names the version that sampled it, and its logprob is that
version's (checked against a forward pass of each version's weights). A generation that
does not take partial rollouts finishes on the version it began on (the load waits for it)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from services.inference_gateway.cpu_server.app import create_app
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.decoding import Decoding, Row
from services.inference_gateway.cpu_server.runner import GenOutput, GenRequest, ModelRunner, SamplingParams
from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint, token_logprobs

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()
JOB = "job-p"


def request(text: str, *, partial: bool, job: str = JOB, seed: int = 1) -> GenRequest:
    prompt = encode_chat(TOK, [{"role": "user", "content": text}])
    params = SamplingParams(max_tokens=400, seed=seed, ignore_eos=True)
    return GenRequest(prompt, params, job_id=job, partial_rollout=partial)


def own_logprobs(model: torch.nn.Module, out: GenOutput) -> list[float]:
    """The model's logprob of each sampled token of ``out``, from one forward pass."""
    ids = torch.tensor([out.prompt_ids + out.token_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
    return lp[len(out.prompt_ids) :]


class Watched:
    """The runner's advance (one token of a running batch), with an event set once a
    batch is decoding."""

    def __init__(self, runner: ModelRunner) -> None:
        self.advance, self.running = runner.advance, threading.Event()
        runner.advance = self  # type: ignore[method-assign]

    def __call__(self, batch: Decoding) -> list[Row]:
        self.running.set()
        return self.advance(batch)


async def run_with_a_reload(
    tmp_path, requests: list[GenRequest]
) -> tuple[list[GenOutput], ModelRunner, torch.nn.Module]:  # noqa: ANN001
    """Start ``requests`` as one batch on version 0 (the base weights, seed 0), load the
    job's version 1 (seed 5) while they decode, and return their outputs (checking the
    scheduler counted one interruption per row that went on on version 1)."""
    runner = ModelRunner(create_model(seed=0), TOK)
    v1 = create_model(seed=5)
    save_checkpoint(v1, tmp_path / "v1", tokenizer=TOK)
    watched = Watched(runner)
    sched = BatchScheduler(runner, max_batch=len(requests), window_ms=50)
    await sched.start()
    try:
        calls = [asyncio.create_task(sched.submit(r)) for r in requests]
        assert await asyncio.to_thread(watched.running.wait, 20), "the batch never started"
        await asyncio.sleep(0.05)  # inside the decode loop
        await sched.reload(tmp_path / "v1", 1, JOB)
        outs = list(await asyncio.wait_for(asyncio.gather(*calls), 60))
    finally:
        await sched.stop()
    assert runner.owner == JOB and runner.version == 1
    assert sched.interruptions == sum(o.interruptions for o in outs)
    return outs, runner, v1


async def test_a_partial_rollout_is_interrupted_and_resumed_on_the_new_version(tmp_path) -> None:
    outs, _, v1 = await run_with_a_reload(
        tmp_path, [request("go", partial=True), request("on", partial=True, seed=2)]
    )
    v0 = create_model(seed=0)
    for out in outs:
        assert len(out.token_ids) == 400 and out.finish_reason == "length"
        assert_cut_once(out, v0, v1)


def assert_cut_once(out: GenOutput, v0: torch.nn.Module, v1: torch.nn.Module) -> None:
    cut = out.token_versions.index(1)
    assert 0 < cut < 400, "begun on version 0, finished on version 1"
    assert out.token_versions == [0] * cut + [1] * (400 - cut)
    assert out.interruptions == 1 and out.policy_version == 1
    # each token's logprob is the one of the weights that sampled it, its context whole
    assert out.logprobs[:cut] == pytest.approx(own_logprobs(v0, out)[:cut], abs=1e-4)
    assert out.logprobs[cut:] == pytest.approx(own_logprobs(v1, out)[cut:], abs=1e-4)
    assert out.text == TOK.decode(out.token_ids)


async def test_a_generation_without_partial_rollouts_finishes_on_its_version(tmp_path) -> None:
    outs, _, _ = await run_with_a_reload(tmp_path, [request("go", partial=False)])
    (out,) = outs
    assert out.token_versions == [0] * 400 and out.interruptions == 0 and out.policy_version == 0
    assert out.logprobs == pytest.approx(own_logprobs(create_model(seed=0), out), abs=1e-4)


async def test_a_row_that_refuses_finishes_on_its_version_and_the_partial_one_goes_on_after(
    tmp_path,
) -> None:
    """An evaluation episode (no partial rollouts) beside a training one of the same job: the
    training row is cut and set aside, the load waits for the evaluation row to finish on
    version 0, then the training row goes on on version 1."""
    outs, _, v1 = await run_with_a_reload(
        tmp_path, [request("go", partial=True), request("eval", partial=False, seed=3)]
    )
    train, evaluation = outs
    v0 = create_model(seed=0)
    assert evaluation.token_versions == [0] * 400 and evaluation.interruptions == 0
    assert evaluation.logprobs == pytest.approx(own_logprobs(v0, evaluation), abs=1e-4)
    assert_cut_once(train, v0, v1)


async def test_another_jobs_partial_rollout_is_not_cut(tmp_path) -> None:
    """A reload of one job leaves another job's partial rollout on its weights (the load
    waits for it)."""
    outs, _, _ = await run_with_a_reload(tmp_path, [request("other", partial=True, job="job-q")])
    (out,) = outs
    assert out.token_versions == [0] * 400 and out.interruptions == 0


async def test_the_cpu_server_answers_with_each_tokens_version() -> None:
    runner = ModelRunner(create_model(seed=0), TOK)
    sched = BatchScheduler(runner, max_batch=2, window_ms=1)
    app = create_app(sched, model_name="tiny")
    body = {
        "prompt": encode_chat(TOK, [{"role": "user", "content": "v"}]),
        "max_tokens": 5,
        "seed": 1,
        "return_token_ids": True,
        "ignore_eos": True,
        "job_id": JOB,
        "partial_rollout": True,
    }
    await sched.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
            r = await c.post("/v1/completions", json=body)
    finally:
        await sched.stop()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_versions"] == [0] * 5 and len(choice["token_ids"]) == 5
