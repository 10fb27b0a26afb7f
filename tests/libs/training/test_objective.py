"""Every part of the objective against a reference written here with numpy and Python
floats (one unpadded sequence and one token at a time), on a fixed batch: advantages,
aggregation, clip bounds, KL estimators, the entropy bonus and overlong responses,
through the real Learner with and without micro-batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from temper.jobspec import Advantage, Aggregation, KLEstimator, Overlong
from temper.policy import create_model
from temper.training import Learner, LearnerConfig, samples_from_groups
from temper.training.grpo import advantages, overlong_penalty
from tests.libs.training.batches import fixed_batch, plain

pytestmark = pytest.mark.timeout(120)


def np_advantages(rewards: np.ndarray, kind: Advantage, eps: float) -> np.ndarray:
    if kind is Advantage.group_norm:
        return (rewards - rewards.mean()) / (rewards.std() + eps)
    if kind is Advantage.group_mean:
        return rewards - rewards.mean()
    n = len(rewards)
    return np.array([rewards[i] - (rewards.sum() - rewards[i]) / (n - 1) for i in range(n)])


def np_penalty(length: int, max_tokens: int, buffer: int) -> float:
    if length <= max_tokens - buffer:
        return 0.0
    return max(-1.0, ((max_tokens - buffer) - length) / buffer)


def reference(policy, ref_model, groups, cfg: LearnerConfig) -> dict[str, float]:
    """The loss of docs/training.md, term by term."""
    high = cfg.clip_eps if cfg.clip_high is None else cfg.clip_high
    rows = []  # (per-token losses, pg terms, kl terms, entropies)
    for group in groups:
        lengths = [sum(t.flat()[1]) for t in group]
        rewards = np.array([t.reward for t in group], dtype=np.float64)
        if cfg.overlong is Overlong.penalty:
            rewards = rewards + np.array(
                [np_penalty(n, cfg.overlong_max_tokens, cfg.overlong_buffer) for n in lengths]
            )
        adv = np_advantages(rewards, cfg.advantage, cfg.adv_eps)
        for traj, a, n in zip(group, adv, lengths, strict=True):
            if cfg.overlong is Overlong.filter and n >= cfg.overlong_max_tokens:
                continue
            ids, own, old = traj.flat()
            cur, ent = plain(policy, ids)
            ref, _ = plain(ref_model, ids)
            terms, pgs, kls, ents = [], [], [], []
            for t in range(1, len(ids)):
                if not own[t]:
                    continue
                ratio = math.exp(cur[t] - old[t])
                pg = -min(ratio * a, min(max(ratio, 1 - cfg.clip_eps), 1 + high) * a)
                d = ref[t] - cur[t]
                kl = -d if cfg.kl_estimator is KLEstimator.k1 else math.exp(d) - d - 1
                terms.append(pg + cfg.kl_coef * kl - cfg.entropy_coef * ent[t])
                pgs.append(pg)
                kls.append(kl)
                ents.append(ent[t])
            rows.append((terms, pgs, kls, ents))
    tokens = sum(len(r[0]) for r in rows)
    if cfg.aggregation is Aggregation.token_mean:
        loss = sum(sum(r[0]) for r in rows) / tokens
    elif cfg.aggregation is Aggregation.seq_mean:
        loss = sum(sum(r[0]) / len(r[0]) for r in rows) / len(rows)
    else:
        loss = sum(sum(r[0]) / cfg.loss_constant for r in rows) / len(rows)
    return {
        "loss": loss,
        "pg": sum(sum(r[1]) for r in rows) / tokens,
        "kl": sum(sum(r[2]) for r in rows) / tokens,
        "entropy": sum(sum(r[3]) for r in rows) / tokens,
        "tokens": tokens,
        "samples": len(rows),
    }


CONFIGS = {
    "grpo_k3": LearnerConfig(clip_eps=0.2, kl_coef=0.05),
    "dr_grpo_seq_sum_k1": LearnerConfig(
        advantage=Advantage.group_mean, aggregation=Aggregation.seq_sum, loss_constant=40.0,
        kl_coef=0.1, kl_estimator=KLEstimator.k1,
    ),
    "dapo_clip_higher_penalty_entropy": LearnerConfig(
        clip_eps=0.2, clip_high=0.28, overlong=Overlong.penalty, overlong_max_tokens=10,
        overlong_buffer=4, entropy_coef=0.01,
    ),
    "rloo_seq_mean_filter": LearnerConfig(
        advantage=Advantage.leave_one_out, aggregation=Aggregation.seq_mean,
        overlong=Overlong.filter, overlong_max_tokens=9, kl_coef=0.02,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_matches_the_reference(name):
    cfg = CONFIGS[name]
    policy, ref_model = create_model(seed=1), create_model(seed=2)
    groups = fixed_batch(policy)
    want = reference(policy, ref_model, groups, cfg)
    if cfg.overlong is Overlong.filter:
        assert 0 < want["samples"] < 8, "the filter removes some samples, not all"

    stats = Learner(create_model(seed=1), cfg, device="cpu", reference=ref_model).step(groups)
    assert stats.updated and stats.skipped_groups == 0
    assert stats.loss == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert stats.pg_loss == pytest.approx(want["pg"], rel=1e-4, abs=1e-6)
    assert stats.kl == pytest.approx(want["kl"], rel=1e-4, abs=1e-6)
    assert stats.model_tokens == want["tokens"]
    assert stats.filtered_samples == 8 - want["samples"]
    # measured on every step, with or without the bonus (it was 0.0 without)
    assert stats.entropy > 0.1 and stats.entropy == pytest.approx(want["entropy"], rel=1e-4)


def grads(cfg: LearnerConfig, groups, budget: int) -> tuple[dict[str, torch.Tensor], float]:
    cfg = LearnerConfig(**{**cfg.__dict__, "micro_batch_tokens": budget})
    learner = Learner(create_model(seed=1), cfg, device="cpu", reference=create_model(seed=2))
    samples, _ = samples_from_groups(groups, objective=cfg.objective())
    learner.optimizer.zero_grad()
    acc = learner.backward(samples)
    got = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    return got, acc.loss, acc.micro_batches


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_micro_batches_give_the_full_batch_loss_and_gradient(name):
    groups = fixed_batch(create_model(seed=1))
    full, full_loss, one = grads(CONFIGS[name], groups, 1 << 20)
    split, split_loss, many = grads(CONFIGS[name], groups, 64)
    assert one == 1 and many > 2
    assert split_loss == pytest.approx(full_loss, abs=1e-5)
    for k, g in full.items():
        assert torch.allclose(split[k], g, atol=1e-5, rtol=0), k


def test_advantages_match_numpy():
    for rewards in ([1.0, 0.0, 0.5], [0.2, 0.9, 0.9, 0.1], [3.0, -1.0]):
        r = np.array(rewards)
        for kind in Advantage:
            assert np.allclose(advantages(rewards, kind, 1e-4), np_advantages(r, kind, 1e-4), atol=1e-12)
    assert advantages([2.0], Advantage.leave_one_out) == [0.0]


def test_overlong_penalty_is_linear_over_the_band():
    assert [overlong_penalty(n, 10, 4) for n in (3, 6, 7, 8, 9, 10, 50)] == [0, 0, -0.25, -0.5, -0.75, -1, -1]
    for n in range(1, 30):
        assert overlong_penalty(n, 20, 5) == pytest.approx(np_penalty(n, 20, 5))


def test_clip_higher_moves_only_the_upper_bound():
    """A token whose ratio is 1.25 with a positive advantage is clipped under the symmetric
    0.2 bound and not under clip-higher 0.28; one at 0.75 with a negative advantage is
    clipped under both."""
    from temper.training.grpo import grpo_token_loss

    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.0, math.log(1.25)], [0.0, math.log(0.75)]])
    mask = torch.tensor([[False, True], [False, True]])
    adv = torch.tensor([1.0, -1.0])
    sym = grpo_token_loss(lp, old, adv, mask, clip_eps=0.2, normalizer=2)
    higher = grpo_token_loss(lp, old, adv, mask, clip_eps=0.2, clip_high=0.28, normalizer=2)
    assert sym.clipped == 2 and higher.clipped == 1
    assert sym.pg_sum == pytest.approx(-1.2 + 0.8)  # the negative side: -min(-0.75, -0.8)
    assert higher.pg_sum == pytest.approx(-1.25 + 0.8)


def test_the_whole_model_forward_measures_the_same_entropy():
    """A sharded model is called whole (``full_forward``: ``token_logprobs`` on the full
    logits); its entropy is the one the output-layer-only path measures."""
    cfg = CONFIGS[sorted(CONFIGS)[0]]
    policy, ref_model = create_model(seed=1), create_model(seed=2)
    groups = fixed_batch(policy)
    want = reference(policy, ref_model, groups, cfg)
    learner = Learner(create_model(seed=1), cfg, device="cpu", reference=ref_model)
    learner.full_forward = True
    stats = learner.step(groups)
    assert stats.entropy > 0.1 and stats.entropy == pytest.approx(want["entropy"], rel=1e-4)
    assert stats.loss == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
