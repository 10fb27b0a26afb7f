"""LoRA training (PEFT), versions published to the registry and loaded back."""

from __future__ import annotations

import pytest
import torch

from temper import registry
from temper.jobspec import AlgorithmSpec, LoraSpec, SpecError, parse_spec
from temper.policy import create_model, default_tokenizer, token_logprobs
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig
from temper.training.lora import LoraTargetError
from tests.libs.training.test_learner import answer, seq_logprob

pytestmark = pytest.mark.timeout(120)

LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])


def base_spec(**algorithm):
    return {
        "name": "j",
        "policy": {"model": "m"},
        "tasks": {"taskset": "ts", "group_size": 2},
        "schedule": {"episodes_per_iteration": 2},
        "algorithm": algorithm,
    }


def test_lora_spec_is_validated_strictly():
    assert AlgorithmSpec().lora is None  # absent: full weights
    spec = parse_spec(base_spec(lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}))
    assert spec.algorithm.lora is not None and spec.algorithm.lora.rank == 8
    for bad, where in [
        ({"rank": 0}, "rank"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["q_proj", "q_proj"]}, "repeat"),
        ({"target_modules": ["q proj;"]}, "not module names"),
        ({"ranks": 4}, "ranks"),
    ]:
        with pytest.raises(SpecError, match=where):
            parse_spec(base_spec(lora=bad))


def test_unknown_target_module_is_refused_with_the_models_names():
    with pytest.raises(LoraTargetError, match="q_proj"):
        Learner(create_model(seed=1), LearnerConfig(lora=LoraSpec(target_modules=["attn_qkv"])), device="cpu")


def _adapted(model) -> set[str]:
    """The layer names (last component) that carry a LoRA adapter."""
    return {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}


def test_the_default_targets_cover_separate_and_fused_projections(tmp_path):
    """By default every attention and MLP projection gets an adapter, under the names the
    model uses: Llama's and Qwen's separate ones, Phi-3's fused qkv_proj and gate_up_proj.
    An explicit separate name on a fused model is refused naming the fused layer."""
    from temper.policy.build import build_model_dir, train_tokenizer
    from temper.policy.model import load_model
    from temper.training.lora import apply_lora

    tok = train_tokenizer(["def add(a, b): return a + b"] * 20, vocab_size=300)
    phi3, _ = load_model(build_model_dir(tmp_path / "phi3", "phi3", tok))
    assert {"qkv_proj", "gate_up_proj"} <= {n.rsplit(".", 1)[-1] for n, _ in phi3.named_modules()}
    assert _adapted(apply_lora(phi3, LoraSpec(rank=2))) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    llama, _ = load_model(build_model_dir(tmp_path / "llama", "llama", tok))
    assert _adapted(apply_lora(llama, LoraSpec(rank=2))) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    phi3, _ = load_model(tmp_path / "phi3")
    with pytest.raises(
        LoraTargetError, match=r"\['q_proj', 'up_proj'\].*it fuses them: name gate_up_proj, qkv_proj"
    ):
        apply_lora(phi3, LoraSpec(target_modules=["q_proj", "up_proj", "o_proj"]))
    # the default is what a spec without target_modules means, and it survives a round trip
    spec = parse_spec(base_spec(lora={"rank": 4}))
    assert spec.algorithm.lora is not None and spec.algorithm.lora.target_modules is None
    assert parse_spec(spec.model_dump(mode="json")).algorithm.lora == spec.algorithm.lora
    # the trainer's learner trains Phi-3 with the default adapter
    learner = Learner(load_model(tmp_path / "phi3")[0], LearnerConfig(lora=LoraSpec(rank=2)), device="cpu")
    assert _adapted(learner.model) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_lora_trains_the_adapter_only_and_the_reference_is_the_base():
    base = create_model(seed=3)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    learner = Learner(
        create_model(seed=3), LearnerConfig(learning_rate=3e-2, kl_coef=0.1, lora=LORA), device="cpu"
    )
    assert learner.reference is None, "no second copy of the weights"
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    start = {t: seq_logprob(learner, t) for t in ("yes", "no")}
    kls = []
    for _ in range(5):
        group = [answer(learner, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0)] * 2)]
        kls.append(learner.step([group]).kl)
    assert kls[0] == pytest.approx(0.0, abs=1e-6), "adapter B starts at zero: policy == reference"
    assert kls[-1] > 1e-5, "the KL term sees the adapter move away from the base"
    after = {t: seq_logprob(learner, t) for t in ("yes", "no")}
    assert after["yes"] > start["yes"] + 0.5 and after["no"] < start["no"] - 0.5
    # the base weights did not move: with the adapter off the model is the original one
    ids = torch.tensor([answer(learner, "yes", 0, 0).flat()[0]])
    learner.model.eval()
    with torch.no_grad(), learner.model.disable_adapter():
        off = token_logprobs(learner.model, ids)
    assert torch.allclose(off, token_logprobs(base, ids), atol=1e-6)
    assert not torch.allclose(token_logprobs(learner.model, ids), off, atol=1e-3)
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())


async def test_lora_and_full_versions_round_trip_through_the_registry(tmp_path):
    store = LocalStore(tmp_path / "objects")
    tok = default_tokenizer()
    for cfg in (LearnerConfig(learning_rate=1e-2, lora=LORA), LearnerConfig(learning_rate=1e-3)):
        a = Learner(create_model(seed=4), cfg, device="cpu")
        group = [answer(a, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0)])]
        a.step([group])
        prefix = registry.version_prefix("t", "job-a", 1)
        key = await a.publish_version(
            store, prefix, job_id="job-a", version=1, base_model="tiny", tokenizer=tok
        )
        manifest = await registry.read_manifest(store, key)
        assert manifest.kind == ("lora" if cfg.lora else "full") and manifest.version == 1
        expected = (
            {"adapter_config.json", "adapter_model.safetensors"}
            if cfg.lora
            else {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
        )
        assert expected <= set(manifest.served_files())
        assert "trainer/optimizer.safetensors" in manifest.files
        b = Learner(create_model(seed=4), cfg, device="cpu")
        await b.load_version(store, key)
        assert (b.version, b.step_count) == (1, 1)
        ids = torch.tensor([answer(a, "yes", 0, 0).flat()[0]])
        assert torch.allclose(token_logprobs(a.model, ids), token_logprobs(b.model, ids), atol=1e-6)


async def test_a_corrupt_version_is_refused(tmp_path):
    store = LocalStore(tmp_path / "objects")
    a = Learner(create_model(seed=5), LearnerConfig(lora=LORA), device="cpu")
    prefix = registry.version_prefix("t", "job-a", 1)
    key = await a.publish_version(store, prefix, job_id="job-a", version=1, base_model="tiny")
    blob = bytearray(await store.get(prefix + "/adapter_model.safetensors"))
    blob[-1] ^= 0xFF
    await store.put(prefix + "/adapter_model.safetensors", bytes(blob))
    with pytest.raises(
        registry.CorruptVersion, match="adapter_model.safetensors does not match its checksum"
    ):
        await registry.fetch_version(store, key, tmp_path / "v1")
    assert not (tmp_path / "v1").exists(), "nothing half-written is left"
    await store.delete(prefix + "/adapter_model.safetensors")
    with pytest.raises(registry.CorruptVersion, match="adapter_model.safetensors is missing"):
        await Learner(create_model(seed=5), LearnerConfig(lora=LORA), device="cpu").load_version(store, key)
    with pytest.raises(registry.CorruptVersion, match="no manifest"):
        await registry.read_manifest(store, registry.manifest_key(registry.version_prefix("t", "job-a", 9)))


def test_retention_keeps_every_file_of_the_latest_registry_version():
    from temper.retention import _stem

    latest = _stem("tenants/t/jobs/j/versions/v2/manifest.json")
    assert latest == "tenants/t/jobs/j/versions/v2/"
    assert "tenants/t/jobs/j/versions/v2/trainer/optimizer.safetensors".startswith(latest)
    assert not "tenants/t/jobs/j/versions/v20/manifest.json".startswith(latest)
