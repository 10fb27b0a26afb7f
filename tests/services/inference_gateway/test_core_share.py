"""The CPU engine in the process's core share (temper.cores, embedded mode): it decodes on
every core while nothing else computes, on its half while the trainer steps, and marks
itself idle once its batch is done, so the trainer's steps get every core meanwhile."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.decoding import Decoding, Row
from services.inference_gateway.cpu_server.runner import GenRequest, ModelRunner, SamplingParams
from temper import cores
from temper.policy import create_model, default_tokenizer, encode_chat

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("torch_threads_restored")]

TOK = default_tokenizer()


async def test_the_engine_decodes_on_every_core_alone_and_on_half_beside_the_trainer() -> None:
    share = cores.share(2)
    runner = ModelRunner(create_model(seed=0), TOK)
    advance, seen = runner.advance, []

    def watched(batch: Decoding) -> list[Row]:
        seen.append(torch.get_num_threads())  # in the runner's thread, as it decodes a token
        return advance(batch)

    runner.advance = watched  # type: ignore[method-assign]
    sched = BatchScheduler(runner, max_batch=1, window_ms=1)
    prompt = encode_chat(TOK, [{"role": "user", "content": "cores"}])
    await sched.start()
    try:
        await sched.submit(GenRequest(prompt, SamplingParams(max_tokens=12, seed=1, ignore_eos=True)))
        alone, seen[:] = list(seen), []
        share.set_busy("trainer", True)  # a step under way
        await sched.submit(GenRequest(prompt, SamplingParams(max_tokens=12, seed=1, ignore_eos=True)))
        beside = list(seen)
        # the batch is done (its last row answered just before): the engine stops counting,
        # so the step gets both cores
        for _ in range(500):
            if share.threads() == 2:
                break
            await asyncio.sleep(0.01)
        assert share.threads() == 2
    finally:
        await sched.stop()
    assert len(alone) >= 11 and set(alone) == {2}, alone
    assert len(beside) >= 11 and set(beside) == {1}, beside
