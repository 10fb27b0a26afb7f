"""Many jobs on one base model: the CPU engine serves each job's LoRA adapter, mixed in
one batch, and every result names the version that produced it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference_gateway.cpu_server.runner import (
    GenRequest,
    ModelRunner,
    NotServed,
    SamplingParams,
    build_runner,
)
from temper import registry
from temper.jobspec import LoraSpec
from temper.policy import create_model, default_tokenizer, encode_chat, token_logprobs
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "Say something."}])
LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])


def adapter_learner(seed: int) -> Learner:
    """A LoRA learner on the seed-0 base whose adapter is moved far from zero."""
    learner = Learner(create_model(seed=0), LearnerConfig(lora=LORA), device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    learner.model.eval()
    return learner


async def publish(store, learner: Learner, job: str, version: int, dest) -> object:
    key = await learner.publish_version(
        store, registry.version_prefix("t", job, version), job_id=job, version=version, base_model="tiny"
    )
    await registry.fetch_version(store, key, dest)
    return dest


def own_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        return token_logprobs(model, ids)[0, len(prompt) :].tolist()


async def test_two_adapters_in_one_batch_each_sample_their_own_weights(tmp_path):
    store = LocalStore(tmp_path / "objects")
    a, b = adapter_learner(1), adapter_learner(2)
    engine = ModelRunner(create_model(seed=0), TOK)
    engine.load_weights(await publish(store, a, "job-a", 3, tmp_path / "a3"), 3)
    engine.load_weights(await publish(store, b, "job-b", 5, tmp_path / "b5"), 5)
    assert engine.holding().adapters == {"job-a": 3, "job-b": 5}

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    outs = engine.generate(
        [
            GenRequest(PROMPT, params, job_id="job-a"),
            GenRequest(PROMPT, params, job_id="job-b"),
            GenRequest(PROMPT, params, job_id=None),  # no adapter: the base weights, version 0
        ]
    )
    assert [(o.adapter, o.policy_version) for o in outs] == [("job-a-v3", 3), ("job-b-v5", 5), (None, 0)]
    base = create_model(seed=0)
    for out, model in zip(outs, (a.model, b.model, base), strict=True):
        mine = own_logprobs(model, PROMPT, out.token_ids)
        assert out.logprobs == pytest.approx(mine, abs=1e-4), "each row ran on its own adapter"
    # The same tokens scored by the other adapter differ: the adapters are not interchangeable.
    other = own_logprobs(b.model, PROMPT, outs[0].token_ids)
    assert max(abs(x - y) for x, y in zip(outs[0].logprobs, other, strict=True)) > 1e-2


async def test_a_new_version_replaces_the_jobs_adapter_and_a_corrupt_one_is_refused(tmp_path):
    store = LocalStore(tmp_path / "objects")
    engine = ModelRunner(create_model(seed=0), TOK)
    engine.load_weights(await publish(store, adapter_learner(1), "job-a", 1, tmp_path / "a1"), 1)
    v2 = adapter_learner(9)
    engine.load_weights(await publish(store, v2, "job-a", 2, tmp_path / "a2"), 2)
    assert engine.served("job-a") == ("job-a-v2", 2)
    assert set(engine.model.peft_config) == {"job-a-v2"}, "the old adapter is dropped"
    out = engine.generate([GenRequest(PROMPT, SamplingParams(max_tokens=4, seed=1), job_id="job-a")])[0]
    assert out.logprobs == pytest.approx(own_logprobs(v2.model, PROMPT, out.token_ids), abs=1e-4)

    d = await publish(store, adapter_learner(3), "job-a", 3, tmp_path / "a3")
    blob = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(registry.CorruptVersion, match="checksum"):
        engine.load_weights(d, 3)
    assert engine.served("job-a") == ("job-a-v2", 2), "a refused version changes nothing"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
async def registry_store(request, tmp_path, unique):
    """The registry on a local directory and on the real S3 server (its own tenant prefix)."""
    if request.param == "local":
        yield LocalStore(tmp_path / "objects"), "t"
        return
    from temper.storage import S3Store

    s3 = S3Store(request.getfixturevalue("s3_settings"))
    await s3.ensure_bucket()
    tenant = f"test-{unique}"
    yield s3, tenant
    for key in await s3.list(f"tenants/{tenant}/"):
        await s3.delete(key)


async def test_two_jobs_on_one_base_model_through_one_gateway_each_sample_their_own_adapter(
    tmp_path, registry_store
):
    """The gateway's own path: policy.updates with manifest keys (fetched and verified from
    the object store), per-job routing, version tags."""
    from services.inference_gateway.inference import Inference
    from services.inference_gateway.local import LocalBackend
    from temper.events import InferenceRequest, PolicyUpdate
    from temper.events import SamplingParams as Sampling
    from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings

    store, tenant = registry_store
    cfg = InferenceSettings(backends=[], checkpoint_cache_dir=str(tmp_path / "cache"))
    spec = BackendSpec(name="local-0", kind=BackendKind.local)
    backend = LocalBackend(spec, model_name="temper-policy", runner=ModelRunner(create_model(seed=0), TOK))
    svc = Inference(cfg, store=store, backends=[backend], tokenizer=TOK)
    await svc.start()
    try:
        learners = {"job-a": adapter_learner(1), "job-b": adapter_learner(2)}

        def request(job: str, version_seen: int = 0) -> InferenceRequest:
            return InferenceRequest(
                job_id=job, episode_id=f"{job}-e", turn=0, attempt=1, model="temper-policy",
                prompt_ids=PROMPT, sampling=Sampling(max_tokens=6, seed=11),
            )  # fmt: skip

        before = await svc.handle(request("job-a"))
        assert before.policy_version == 0, "no version loaded yet: the base model"
        for job, version in (("job-a", 2), ("job-b", 7)):
            key = await learners[job].publish_version(
                store,
                registry.version_prefix("t", job, version),
                job_id=job,
                version=version,
                base_model="tiny",
            )
            await svc.apply_update(
                PolicyUpdate(job_id=job, version=version, checkpoint_key=key, step=version)
            )
        assert (svc.confirmed("job-a"), svc.confirmed("job-b")) == (2, 7)
        a, b = await asyncio.gather(svc.handle(request("job-a")), svc.handle(request("job-b")))
        assert (a.policy_version, b.policy_version) == (2, 7)
        for res, job in ((a, "job-a"), (b, "job-b")):
            assert res.error is None
            assert res.logprobs == pytest.approx(
                own_logprobs(learners[job].model, PROMPT, res.token_ids), abs=1e-4
            )
        other = own_logprobs(learners["job-b"].model, PROMPT, a.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, other, strict=True)) > 1e-2
        # an update for one job leaves the other's requests on its own version
        key = await learners["job-a"].publish_version(
            store, registry.version_prefix(tenant, "job-a", 3), job_id="job-a", version=3, base_model="tiny"
        )
        await svc.apply_update(PolicyUpdate(job_id="job-a", version=3, checkpoint_key=key, step=3))
        assert (await svc.handle(request("job-b"))).policy_version == 7
        assert (await svc.handle(request("job-a"))).policy_version == 3
    finally:
        await svc.stop()


async def test_an_adapter_that_fails_to_load_leaves_the_runner_as_it_was(tmp_path):
    """PEFT puts an adapter's layers into the model before it reads the weights: a load that
    fails there (weights of another rank) must not leave them in the base."""
    import json

    store = LocalStore(tmp_path / "objects")
    d = await publish(store, adapter_learner(1), "job-a", 1, tmp_path / "a1")
    config = json.loads((d / "adapter_config.json").read_text())
    config["r"] = 8  # the weights are rank 4
    (d / "adapter_config.json").write_text(json.dumps(config))
    for runner in (ModelRunner(create_model(seed=0), TOK), build_runner(preset="tiny", seed=0)):
        with pytest.raises(RuntimeError, match="size mismatch"):
            runner.load_adapter(d, job_id="job-a", version=1)
        assert runner.holding().adapters == {}
        assert not [n for n, _ in runner.base.named_parameters() if "lora_" in n]
        out = runner.generate([GenRequest(PROMPT, SamplingParams(max_tokens=4, seed=2), job_id="job-a")])[0]
        assert (out.adapter, out.policy_version) == (None, 0)
        assert out.logprobs == pytest.approx(
            own_logprobs(create_model(seed=0), PROMPT, out.token_ids), abs=1e-4
        )


async def test_a_version_is_loaded_for_the_job_named_and_leaves_its_own_jobs_weights_alone(tmp_path):
    """An evaluation job serves another job's version as its own: the version loads under the
    job the gateway names, so the job that trained it keeps its newer adapter (or, with full
    weights, its backend)."""
    store = LocalStore(tmp_path / "objects")
    old, new = adapter_learner(1), adapter_learner(2)
    engine = ModelRunner(create_model(seed=0), TOK)
    engine.load_weights(await publish(store, new, "job-a", 4, tmp_path / "a4"), 4)
    engine.load_weights(await publish(store, old, "job-a", 2, tmp_path / "a2"), 2, job_id="job-eval")
    assert engine.holding().adapters == {"job-a": 4, "job-eval": 2}
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    outs = engine.generate(
        [GenRequest(PROMPT, params, job_id="job-a"), GenRequest(PROMPT, params, job_id="job-eval")]
    )
    assert [(o.adapter, o.policy_version) for o in outs] == [("job-a-v4", 4), ("job-eval-v2", 2)]
    for out, model in zip(outs, (new.model, old.model), strict=True):
        assert out.logprobs == pytest.approx(own_logprobs(model, PROMPT, out.token_ids), abs=1e-4)
    # full weights: the runner is owned by the job named, not by the one that trained them
    full_learner = Learner(create_model(seed=5), LearnerConfig(), device="cpu")
    key = await full_learner.publish_version(
        store, registry.version_prefix("t", "job-b", 3), job_id="job-b", version=3, base_model="tiny"
    )
    await registry.fetch_version(store, key, tmp_path / "b3")
    other = ModelRunner(create_model(seed=0), TOK)
    other.load_weights(tmp_path / "b3", 3, job_id="job-eval-b")
    assert (other.holding().owner, other.holding().version) == ("job-eval-b", 3)
    with pytest.raises(NotServed, match="holds job 'job-eval-b'"):  # no job named: the manifest's, refused
        other.load_weights(tmp_path / "b3", 3)
    assert other.holding().owner == "job-eval-b"
