"""The DPO loss of the learner against an independent numpy reference, on full weights
(a frozen copy as reference) and LoRA (the adapter off as reference, as the KL term's)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from temper.jobspec import LoraSpec
from temper.policy import create_model, default_tokenizer
from temper.training import Learner, LearnerConfig
from temper.training.sft import encode_chat

TOK = default_tokenizer()
BETA = 0.5


def reply(question: str, answer: str) -> tuple[list[int], list[bool]]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return encode_chat(TOK, messages, [False, True])


PAIRS = [
    (reply("colour of the sky?", "blue"), reply("colour of the sky?", "green, surely")),
    (reply("two plus two?", "four"), reply("two plus two?", "five")),
    (reply("capital of France?", "Paris"), reply("capital of France?", "Lyon")),
]


def numpy_logprob(model: torch.nn.Module, ids: list[int], mask: list[bool]) -> float:
    """Sum of log p of the masked tokens, from the logits with numpy's log-softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    z = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = logp[np.arange(len(ids) - 1), np.array(ids[1:])]
    return float((picked * np.array(mask[1:], dtype=float)).sum())


def numpy_dpo(policy: torch.nn.Module, reference: torch.nn.Module) -> float:
    losses = []
    for (c_ids, c_mask), (r_ids, r_mask) in PAIRS:
        d_chosen = numpy_logprob(policy, c_ids, c_mask) - numpy_logprob(reference, c_ids, c_mask)
        d_rejected = numpy_logprob(policy, r_ids, r_mask) - numpy_logprob(reference, r_ids, r_mask)
        margin = BETA * (d_chosen - d_rejected)
        losses.append(np.logaddexp(0.0, -margin))  # -log sigmoid(margin)
    return float(np.mean(losses))


def dpo_learner(model: torch.nn.Module, *, budget: int = 8192, lora: LoraSpec | None = None) -> Learner:
    config = LearnerConfig(
        learning_rate=1e-2, dpo_beta=BETA, bf16=False, micro_batch_tokens=budget, lora=lora
    )
    return Learner(model, config, device="cpu", pad_id=TOK.pad_id)


def test_the_dpo_loss_matches_numpy_with_a_frozen_reference_however_the_batch_is_cut(monkeypatch):
    start = create_model("tiny", seed=3)
    results = []
    clip = torch.nn.utils.clip_grad_norm_

    def keep(params, max_norm):  # the gradient as the step has it (AdamW's first step is sign-like)
        params = list(params)
        results.append(torch.cat([p.grad.detach().flatten() for p in params]))
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", keep)
    for budget in (64, 100_000):  # one pair a micro-batch, and all of them in one
        learner = dpo_learner(copy.deepcopy(start), budget=budget)
        with torch.no_grad():  # move the policy off its reference, so the margins are not 0
            for p in learner.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        expected = numpy_dpo(learner.model, learner.reference)
        assert abs(expected - math.log(2)) > 1e-3  # the margins are not 0
        stats = learner.step_pairs(PAIRS)
        assert stats.loss == pytest.approx(expected, rel=1e-5)
        assert stats.micro_batches == (3 if budget == 64 else 1)
        # the reference is frozen: still the initial weights
        for a, b in zip(learner.reference.parameters(), start.parameters(), strict=True):
            torch.testing.assert_close(a, b)
    assert len(results) == 2 and results[0].abs().sum() > 0
    torch.testing.assert_close(results[0], results[1], rtol=1e-3, atol=1e-6)  # fp32, padded shapes


def test_under_lora_the_reference_is_the_adapter_off_and_the_loss_falls():
    base = create_model("tiny", seed=5)
    learner = dpo_learner(copy.deepcopy(base), lora=LoraSpec(rank=4, alpha=8))
    assert learner.reference is None  # no second copy: the adapter off is the reference
    first = learner.step_pairs(PAIRS)
    assert first.loss == pytest.approx(math.log(2), abs=1e-6)  # a fresh adapter (B = 0) is the base
    losses = [learner.step_pairs(PAIRS).loss for _ in range(15)]
    assert losses[-1] < math.log(2) - 0.1, losses
    from temper.training.lora import reference_off

    with reference_off(learner.model):
        expected = numpy_dpo(learner.model, base)  # reference-off model vs the untouched base: 0 margin
    assert expected == pytest.approx(math.log(2), abs=1e-6)
    assert numpy_dpo(learner.model, base) == pytest.approx(losses[-1], abs=0.05)


def test_a_dpo_job_spec_gives_the_learner_its_beta_and_a_reference():
    from temper.jobspec import parse_spec

    spec = parse_spec(
        {"name": "d", "policy": {"model": "m"}, "tasks": {"taskset": "t"},
         "algorithm": {"name": "dpo", "beta": 0.3, "learning_rate": 1e-3}}
    )  # fmt: skip
    config = LearnerConfig.from_spec(spec.algorithm)
    assert config.dpo_beta == 0.3 and not config.sft and not config.reward_model
    learner = Learner(create_model("tiny", seed=0), config, device="cpu")
    assert learner.reference is not None  # the frozen copy DPO's margin is taken against
    stats = learner.step_pairs(PAIRS)
    assert stats.updated and stats.loss == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    assert stats.pg_loss == stats.loss and stats.pair_accuracy == 0.0  # no margin yet: none ranked right
