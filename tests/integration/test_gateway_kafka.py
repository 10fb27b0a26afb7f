"""The inference gateway on the real Kafka (and S3 for checkpoints): real generations
from the CPU engine in, result messages out; backpressure pausing the consumer; results
tagged with the policy version a Kafka policy update switched to.

The topics are the shared fixed names, so every consumer group here is new and starts at
the current end (nothing other tests left is replayed), and results are picked out by
this test's own job id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.inference_gateway.component import Gateway
from temper.bus import Record
from temper.bus.kafka import start_groups_at_end
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate, SamplingParams, Topics, decode
from temper.policy import create_model, default_tokenizer, encode_chat, save_weights, token_logprobs
from temper.runtime import Runtime
from temper.settings import BusKind, BusSettings, Settings
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(120)]
TOK = default_tokenizer()


class Harness:
    def __init__(self, runtime: Runtime, gateway: Gateway, job: str) -> None:
        self.runtime, self.gateway, self.job = runtime, gateway, job
        self.results: list[InferenceResult] = []

    async def collect(self, record: Record) -> None:
        msg = decode(record.value)
        if isinstance(msg, InferenceResult) and msg.job_id == self.job:
            self.results.append(msg)

    async def send(self, req: InferenceRequest) -> None:
        assert self.runtime.bus is not None
        await self.runtime.bus.send_message(Topics.INFERENCE_REQUESTS, req)

    async def wait_results(self, n: int, limit_s: float = 60) -> list[InferenceResult]:
        deadline = asyncio.get_running_loop().time() + limit_s
        while len(self.results) < n:
            assert asyncio.get_running_loop().time() < deadline, f"{len(self.results)}/{n} results"
            await asyncio.sleep(0.05)
        return self.results

    async def stop(self) -> None:
        await self.gateway.stop()
        await self.runtime.stop()


async def start(
    tmp: Path,
    bootstrap: str,
    s3,
    unique: str,
    *,
    max_inflight: int = 8,  # noqa: ANN001
    concurrency: int | None = None,
) -> Harness:
    settings = Settings(
        bus=BusSettings(kind=BusKind.kafka, bootstrap=bootstrap, retry_backoff_s=0.05),
        storage=s3,
        data_dir=tmp,
        inference=InferenceSettings(
            backends=[BackendSpec(name="local-0", kind=BackendKind.local, max_inflight=max_inflight)],
            checkpoint_cache_dir=str(tmp / "cache"),
        ),
    )
    runtime = Runtime(settings, service="inference-gateway", needs_db=False)
    await runtime.start()
    group, policy_group, results_group = (
        f"test-gw-{unique}",
        f"test-gw-{unique}-policy",
        f"test-gw-{unique}-res",
    )
    await start_groups_at_end(
        bootstrap,
        {
            group: [Topics.INFERENCE_REQUESTS],
            policy_group: [Topics.POLICY_UPDATES],
            results_group: [Topics.INFERENCE_RESULTS],
        },
    )
    gateway = Gateway(runtime, group=group, policy_group=policy_group, concurrency=concurrency)
    await gateway.start()
    h = Harness(runtime, gateway, job=f"gwjob-{unique}")
    assert runtime.bus is not None
    await runtime.bus.subscribe([Topics.INFERENCE_RESULTS], results_group, h.collect)
    return h


def request(h: Harness, episode: str, content: str = "hi", **sampling: object) -> InferenceRequest:
    prompt = encode_chat(TOK, [{"role": "user", "content": content}])
    return InferenceRequest(
        job_id=h.job,
        episode_id=f"{h.job}-{episode}",
        turn=0,
        attempt=1,
        model="temper-policy",
        prompt_ids=prompt,
        sampling=SamplingParams(**{"max_tokens": 6, "seed": 5, **sampling}),
    )


async def test_gateway_serves_real_generations_over_kafka(
    tmp_path, kafka_bootstrap, s3_settings, unique
) -> None:  # noqa: ANN001
    h = await start(tmp_path, kafka_bootstrap, s3_settings, unique)
    try:
        reqs = [
            request(h, f"e{i}", content=f"question {i}", temperature=0.0 if i == 0 else 1.0) for i in range(4)
        ]
        for r in reqs:
            await h.send(r)
        results = {r.episode_id: r for r in await h.wait_results(4)}
        assert set(results) == {r.episode_id for r in reqs}
        for req in reqs:
            res = results[req.episode_id]
            assert res.error is None and res.backend == "local-0" and res.policy_version == 0
            assert (res.turn, res.attempt) == (0, 1)
            assert 1 <= len(res.token_ids) == len(res.logprobs) <= 6
        # the logprobs are the model's: recompute the greedy one with a forward pass
        import torch

        slot = h.gateway.inference.router.slots["local-0"]
        model = slot.backend.runner.model  # type: ignore[attr-defined]
        res = results[reqs[0].episode_id]
        ids = torch.tensor([reqs[0].prompt_ids + res.token_ids])
        mask = torch.ones_like(ids)
        comp = torch.zeros_like(ids)
        comp[0, len(reqs[0].prompt_ids) :] = 1
        with torch.no_grad():
            lp = token_logprobs(model, ids, mask, comp)[0, len(reqs[0].prompt_ids) :]
        assert lp.tolist() == pytest.approx(res.logprobs, abs=1e-4)
    finally:
        await h.stop()


async def test_backpressure_pauses_the_kafka_consumer_and_answers_everything(
    tmp_path,
    kafka_bootstrap,
    s3_settings,
    unique,  # noqa: ANN001
) -> None:
    # one request in flight at a time, while four partitions may be handled at once
    h = await start(tmp_path, kafka_bootstrap, s3_settings, unique, max_inflight=1, concurrency=4)
    try:
        n = 12
        for i in range(n):
            await h.send(request(h, f"bp{i}", max_tokens=8))
        results = await h.wait_results(n)
        assert sorted(r.episode_id for r in results) == sorted(f"{h.job}-bp{i}" for i in range(n))
        assert all(r.error is None and r.token_ids for r in results)
        assert h.gateway.flow.pauses > 0  # the consumer was paused while the backend was full
        await asyncio.sleep(0.1)
        assert not h.gateway.requests.paused  # and resumed once it was free
    finally:
        await h.stop()


async def test_results_carry_the_version_a_kafka_policy_update_switched_to(
    tmp_path,
    kafka_bootstrap,
    s3_settings,
    unique,  # noqa: ANN001
) -> None:
    from temper.storage import make_store

    h = await start(tmp_path, kafka_bootstrap, s3_settings, unique)
    try:
        greedy = {"temperature": 0.0, "max_tokens": 5}
        await h.send(request(h, "before", **greedy))
        (before,) = await h.wait_results(1)
        assert before.policy_version == 0
        # the trainer's layout: weights at .../checkpoints/v<n>.safetensors in the object store
        key = f"tenants/t/jobs/{h.job}/checkpoints/v1.safetensors"
        store = h.runtime.store or make_store(h.runtime.settings)
        await store.put(key, save_weights(create_model(seed=21), tmp_path / "v1.safetensors").read_bytes())
        await h.runtime.bus.send_message(
            Topics.POLICY_UPDATES, PolicyUpdate(job_id=h.job, version=1, checkpoint_key=key, step=4)
        )
        deadline = asyncio.get_running_loop().time() + 30
        while (h.gateway.inference.confirmed(h.job) or 0) < 1:
            assert asyncio.get_running_loop().time() < deadline, "policy update not applied"
            await asyncio.sleep(0.05)
        await h.send(request(h, "after", **greedy))
        results = await h.wait_results(2)
        after = next(r for r in results if r.episode_id.endswith("after"))
        assert after.policy_version == 1 and after.error is None
        assert after.logprobs != before.logprobs  # new weights
        assert h.gateway.updates.update_errors == 0
    finally:
        await h.stop()


async def test_two_jobs_share_one_gateway_each_sampling_its_own_adapter(
    tmp_path,
    kafka_bootstrap,
    s3_settings,
    unique,  # noqa: ANN001
) -> None:
    """Two LoRA jobs on one base model: versions published to the registry on S3, updates
    over Kafka, requests of each job answered by its own adapter (shown by the logprobs)."""
    import torch

    from temper import registry
    from temper.jobspec import LoraSpec
    from temper.storage import make_store
    from temper.training import Learner, LearnerConfig

    h = await start(tmp_path, kafka_bootstrap, s3_settings, unique)
    jobs = {f"{h.job}-a": (1, 3), f"{h.job}-b": (2, 5)}  # job -> (adapter seed, version)
    got: list[InferenceResult] = []

    async def collect(record: Record) -> None:
        msg = decode(record.value)
        if isinstance(msg, InferenceResult) and msg.job_id in jobs:
            got.append(msg)

    assert h.runtime.bus is not None
    await start_groups_at_end(kafka_bootstrap, {f"test-gw-{unique}-res2": [Topics.INFERENCE_RESULTS]})
    await h.runtime.bus.subscribe([Topics.INFERENCE_RESULTS], f"test-gw-{unique}-res2", collect)
    store = h.runtime.store or make_store(h.runtime.settings)
    learners = {}
    try:
        for job, (seed, version) in jobs.items():
            learner = Learner(
                create_model(seed=0), LearnerConfig(lora=LoraSpec(rank=4, target_modules=["q_proj", "v_proj"])),
                device="cpu",
            )  # fmt: skip
            with torch.no_grad():
                g = torch.Generator().manual_seed(seed)
                for name, p in learner.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            learner.model.eval()
            learners[job] = learner
            key = await learner.publish_version(
                store,
                registry.version_prefix("t", job, version),
                job_id=job,
                version=version,
                base_model="tiny",
            )
            await h.runtime.bus.send_message(
                Topics.POLICY_UPDATES,
                PolicyUpdate(job_id=job, version=version, checkpoint_key=key, step=version),
            )
        deadline = asyncio.get_running_loop().time() + 30
        while {j: h.gateway.inference.confirmed(j) for j in jobs} != {j: v for j, (_, v) in jobs.items()}:
            assert asyncio.get_running_loop().time() < deadline, (
                f"updates not applied: {h.gateway.inference.table.snapshot()}"
            )
            await asyncio.sleep(0.05)
        prompt = encode_chat(TOK, [{"role": "user", "content": "same prompt"}])
        for job in jobs:
            await h.send(
                InferenceRequest(
                    job_id=job, episode_id=f"{job}-e", turn=0, attempt=1, model="temper-policy",
                    prompt_ids=prompt, sampling=SamplingParams(max_tokens=6, seed=9),
                )
            )  # fmt: skip
        deadline = asyncio.get_running_loop().time() + 60
        while len(got) < 2:
            assert asyncio.get_running_loop().time() < deadline, f"{len(got)}/2 results"
            await asyncio.sleep(0.05)
        for res in got:
            assert res.error is None and res.policy_version == jobs[res.job_id][1]
            ids = torch.tensor([prompt + res.token_ids])
            with torch.no_grad():
                own = token_logprobs(learners[res.job_id].model, ids)[0, len(prompt) :].tolist()
            assert res.logprobs == pytest.approx(own, abs=1e-4), "sampled from its own adapter"
            other = next(j for j in jobs if j != res.job_id)
            with torch.no_grad():
                theirs = token_logprobs(learners[other].model, ids)[0, len(prompt) :].tolist()
            assert max(abs(x - y) for x, y in zip(res.logprobs, theirs, strict=True)) > 1e-2
        assert h.gateway.updates.update_errors == 0
    finally:
        await h.stop()
        for job in jobs:
            for key in await store.list(f"tenants/t/jobs/{job}/"):
                await store.delete(key)
