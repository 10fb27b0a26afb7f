"""Several jobs' LoRA adapters on one base model in memory (SharedBase): each trains as it
would alone, and the base weights exist once and do not move."""

from __future__ import annotations

import pytest
import torch

from temper import registry
from temper.jobspec import LoraSpec
from temper.policy import create_model
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig
from temper.training.lora import LoraTargetError, SharedBase
from tests.libs.training.test_learner import answer

pytestmark = pytest.mark.timeout(120)

# two jobs with different adapters: job A also has the KL term (its reference: the base)
LORA_A = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
LORA_B = LoraSpec(rank=2, alpha=4, target_modules=["q_proj", "o_proj", "up_proj"])
CONFIG_A = LearnerConfig(learning_rate=3e-2, kl_coef=0.1, lora=LORA_A)
CONFIG_B = LearnerConfig(learning_rate=1e-2, lora=LORA_B)


def batch(learner: Learner, n: int) -> list[list]:
    answers = [("yes", 1.0), ("no", 0.0)] if n % 2 == 0 else [("no", 1.0), ("yes", 0.0)]
    return [[answer(learner, t, r, i) for i, (t, r) in enumerate(answers * 2)]]


def test_two_adapters_on_one_base_train_as_they_would_alone():
    shared = SharedBase(create_model(seed=3), key="tiny")
    a = Learner(shared, CONFIG_A, device="cpu")
    b = Learner(shared, CONFIG_B, device="cpu")
    assert a.model is b.model and a.reference is None and b.reference is None

    # the same jobs, each alone on its own copy of the base, from the same adapters
    alone_a = Learner(create_model(seed=3), CONFIG_A, device="cpu")
    alone_b = Learner(create_model(seed=3), CONFIG_B, device="cpu")
    alone_a.load_adapter(a.adapter_weights())
    alone_b.load_adapter(b.adapter_weights())

    # the jobs step in turn on the shared base; each alone learner gets the same batches
    kls = []
    for n in range(3):
        batch_a, batch_b = batch(a, n), batch(b, n + 1)
        kls.append(a.step(batch_a).kl)
        assert b.step(batch_b).updated
        alone_a.step(batch_a)
        alone_b.step(batch_b)
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[-1] > 1e-6, "A's KL is to the base"

    for shared_learner, alone in ((a, alone_a), (b, alone_b)):
        mine, theirs = shared_learner.adapter_weights(), alone.adapter_weights()
        assert mine.keys() == theirs.keys()
        assert all(torch.allclose(mine[k], theirs[k], atol=1e-6, rtol=0) for k in mine)
    # they moved (a fresh adapter's B matrices are zero)
    assert all(
        any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in learner.adapter_weights().items())
        for learner in (a, b)
    )

    # the base: unchanged, and held once (one tensor per weight, whatever the number of jobs)
    fresh = create_model(seed=3).state_dict()
    base = {n: p for n, p in a.model.named_parameters() if "lora_" not in n}
    assert len(base) == len(list(create_model(seed=3).parameters()))
    assert all(not p.requires_grad for p in base.values())
    for name, p in a.model.get_base_model().named_parameters():  # type: ignore[operator]
        if "lora_" not in name:
            assert torch.equal(p, fresh[name.replace(".base_layer", "")]), name
    assert {p.data_ptr() for p in shared.base_parameters()} == {p.data_ptr() for p in base.values()}
    adapters = sum(p.numel() for n, p in a.model.named_parameters() if "lora_" in n)
    total = sum(p.numel() for p in a.model.parameters())
    assert total == sum(p.numel() for p in create_model(seed=3).parameters()) + adapters
    # each optimizer holds its own adapter's weights, nothing else
    owned_a = {id(p) for g in a.optimizer.param_groups for p in g["params"]}
    owned_b = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    names = {id(p): n for n, p in a.model.named_parameters()}
    assert owned_a and all(f".{a.adapter}." in names[i] for i in owned_a)
    assert owned_b and all(f".{b.adapter}." in names[i] for i in owned_b)


async def test_a_shared_learner_publishes_and_resumes_like_a_lone_one(tmp_path):
    """A version published from a shared base is the same adapter directory as a lone
    learner's, and loads into either kind."""
    store = LocalStore(tmp_path / "objects")
    shared = SharedBase(create_model(seed=4), key="tiny")
    a, b = Learner(shared, CONFIG_A, device="cpu"), Learner(shared, CONFIG_B, device="cpu")
    a.step(batch(a, 0))
    b.step(batch(b, 1))
    key = await b.publish_version(
        store, registry.version_prefix("t", "job-b", 1), job_id="job-b", version=1, base_model="tiny"
    )
    manifest = await registry.read_manifest(store, key)
    assert manifest.kind == "lora"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest.served_files())
    lone = Learner(create_model(seed=4), CONFIG_B, device="cpu")
    await lone.load_version(store, key)
    again = Learner(shared, CONFIG_B, device="cpu")  # a restarted job B on the same base
    await again.load_version(store, key)
    for other in (lone, again):
        assert (other.version, other.step_count) == (1, 1)
        got, want = other.adapter_weights(), b.adapter_weights()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert (
            other.optimizer.state_dict()["state"][0]["step"] == b.optimizer.state_dict()["state"][0]["step"]
        )


def test_a_shared_base_refuses_a_full_weights_job_and_an_unknown_target():
    shared = SharedBase(create_model(seed=1))
    with pytest.raises(ValueError, match="no algorithm.lora"):
        Learner(shared, LearnerConfig(), device="cpu")
    with pytest.raises(LoraTargetError, match="attn_qkv"):
        Learner(shared, LearnerConfig(lora=LoraSpec(target_modules=["attn_qkv"])), device="cpu")
    Learner(shared, CONFIG_A, device="cpu")
    with pytest.raises(LoraTargetError, match="attn_qkv"):
        Learner(shared, LearnerConfig(lora=LoraSpec(target_modules=["attn_qkv"])), device="cpu")
    assert len(shared.adapters) == 1
