"""Memory planned before the first step, and the options that change it: gradient
checkpointing and the micro-batch token budget."""

from __future__ import annotations

import logging

import pytest
import torch

from temper.policy import create_model
from temper.training import Learner, LearnerConfig, samples_from_groups
from temper.training.memory import GiB, MemoryPlanError, Shape, estimate, model_shape, size
from tests.libs.training.batches import fixed_batch

pytestmark = pytest.mark.timeout(60)


def test_weights_gradients_and_optimizer_are_counted_exactly():
    learner = Learner(create_model(seed=1), LearnerConfig(), device="cpu")
    n = sum(p.numel() for p in learner.model.parameters())
    plan = learner.memory_plan
    assert (plan.weights, plan.gradients, plan.optimizer, plan.reference) == (4 * n, 4 * n, 8 * n, 0)
    learner.step(fixed_batch(learner.model))
    state = learner.optimizer.state_dict()["state"].values()
    moments = sum(t.numel() * t.element_size() for s in state for k, t in s.items() if k != "step")
    assert moments == plan.optimizer
    with_kl = Learner(create_model(seed=1), LearnerConfig(kl_coef=0.1), device="cpu").memory_plan
    assert with_kl.reference == 4 * n, "the KL term keeps a copy of the initial policy"


def test_checkpointing_a_smaller_budget_and_lora_shrink_the_plan():
    model = create_model(seed=1)
    shape = model_shape(model)
    base = estimate(shape, micro_batch_tokens=8192)
    assert (
        estimate(shape, micro_batch_tokens=8192, gradient_checkpointing=True).activations < base.activations
    )
    assert estimate(shape, micro_batch_tokens=4096).activations == base.activations // 2
    assert estimate(shape, micro_batch_tokens=8192, bf16=True).activations < base.activations
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)  # tied to the embeddings: a small trainable part
    frozen = estimate(model_shape(model), micro_batch_tokens=8192)
    assert frozen.weights == base.weights and frozen.optimizer < base.optimizer


def test_the_activation_peak_is_the_largest_moment_of_the_step():
    # a large vocabulary on a small body, with gradient checkpointing (each layer's fp32 input kept)
    shape = Shape(params=4_000_000, trainable=4_000_000, layers=2, hidden=64, kv=32, intermediate=128,
                  vocab=50_000, tied=True, head_trainable=True, embedding_trainable=True)  # fmt: skip
    kept = 4 * 1024 * 2 * 64
    # the output layer's backward: log-softmax, its gradient and the scatter's copy, 12 bytes
    # a vocabulary entry for each scored position only
    long = estimate(shape, micro_batch_tokens=1024, scored_tokens=512, gradient_checkpointing=True)
    assert long.activations == kept + 12 * 512 * 50_000
    assert (
        estimate(shape, micro_batch_tokens=1024, gradient_checkpointing=True).activations
        == kept + 12 * 1024 * 50_000
    )
    # few tokens: the tied embedding's backward (its gradient, the output layer's, their sum)
    short = estimate(shape, micro_batch_tokens=16, scored_tokens=8, gradient_checkpointing=True)
    assert short.activations == 3 * 4 * 50_000 * 64
    # a frozen output layer and embedding (an adapter): no weight gradients of the vocabulary
    frozen = Shape(
        **{**shape.__dict__, "trainable": 10_000, "head_trainable": False, "embedding_trainable": False}
    )
    assert estimate(
        frozen, micro_batch_tokens=16, scored_tokens=8, gradient_checkpointing=True
    ).activations == (4 * 16 * 2 * 64 + 12 * 8 * 50_000)


def test_sharding_over_ranks_divides_weights_gradients_and_optimizer():
    shape = model_shape(create_model(seed=1))
    one = estimate(shape, micro_batch_tokens=8192, reference=True)
    four = estimate(shape, micro_batch_tokens=8192, reference=True, ranks=4)
    layer = 4 * (shape.params // shape.layers)
    assert four.weights == one.weights // 4 + 2 * layer, "a shard, and two layers gathered"
    assert (four.gradients, four.optimizer) == (one.gradients // 4, one.optimizer // 4)
    assert (four.reference, four.activations) == (one.reference, one.activations)
    assert "per rank of 4 (FSDP)" in four.describe()


def test_a_job_that_cannot_fit_is_refused_with_the_estimate_and_the_fix(caplog):
    shape = model_shape(create_model(seed=1))
    plain = estimate(shape, micro_batch_tokens=8192)
    ckpt = estimate(shape, micro_batch_tokens=8192, gradient_checkpointing=True)
    limit_gb = (plain.total + ckpt.total) / 2 / GiB
    with pytest.raises(MemoryPlanError) as exc:
        Learner(create_model(seed=1), LearnerConfig(memory_limit_gb=limit_gb), device="cpu")
    text = str(exc.value)
    assert (
        f"the job needs about {size(plain.total)} (weights 1.6 MiB, gradients 1.6 MiB, optimizer 3.3 MiB"
        in text
    )
    assert "more than the " + size(int(limit_gb * GiB)) in text
    assert "it would fit with algorithm.gradient_checkpointing: true" in text

    with caplog.at_level(logging.INFO, logger="temper.training"):
        fits = Learner(
            create_model(seed=1),
            LearnerConfig(memory_limit_gb=limit_gb, gradient_checkpointing=True),
            device="cpu",
        )
    assert fits.memory_plan.total == ckpt.total
    assert any(r.getMessage() == "memory plan" for r in caplog.records), "the plan is logged at start"


def test_gradient_checkpointing_gives_the_same_gradient():
    groups = fixed_batch(create_model(seed=1))
    got = {}
    for ckpt in (False, True):
        learner = Learner(
            create_model(seed=1),
            LearnerConfig(gradient_checkpointing=ckpt, micro_batch_tokens=128),
            device="cpu",
        )
        assert learner.model.is_activation_checkpointing is ckpt
        samples, _ = samples_from_groups(groups, objective=learner.config.objective())
        learner.optimizer.zero_grad()
        learner.backward(samples)
        got[ckpt] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert got[False].keys() == got[True].keys()
    for name, g in got[False].items():
        assert torch.allclose(got[True][name], g, atol=1e-6, rtol=0), name
