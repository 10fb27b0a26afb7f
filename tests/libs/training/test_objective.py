"""Every part of the objective against a reference written here with numpy and Python
floats (one unpadded sequence and one token at a time), on a fixed batch: advantages,
aggregation, clip bounds, KL estimators, the entropy bonus, overlong responses and the
train/inference mismatch corrections (TIS, MIS),
through the real Learner with and without micro-batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from temper.jobspec import Advantage, Aggregation, Correction, CorrectionLevel, KLEstimator, Overlong
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
    corrected: list[bool] = []  # per token: its rho passed the cap
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
            scored = [t for t in range(1, len(ids)) if own[t]]
            seq_log_rho = sum(cur[t] - old[t] for t in scored)
            for t in scored:
                if cfg.correction is Correction.none:
                    ratio, c = math.exp(cur[t] - old[t]), 1.0
                else:  # against the trainer's own logprob (this step's weights): ratio 1
                    ratio = 1.0
                    rho = math.exp(
                        seq_log_rho if cfg.correction_level is CorrectionLevel.sequence else cur[t] - old[t]
                    )
                    capped = rho > cfg.correction_cap
                    corrected.append(capped)
                    if cfg.correction is Correction.tis:
                        c = min(rho, cfg.correction_cap)
                    else:
                        c = 0.0 if capped else rho
                pg = -c * min(ratio * a, min(max(ratio, 1 - cfg.clip_eps), 1 + high) * a)
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
        "capped": sum(corrected) / tokens,
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
    "tis_token": LearnerConfig(correction=Correction.tis, correction_cap=1.05, kl_coef=0.05),
    "mis_token_seq_mean": LearnerConfig(
        correction=Correction.mis, correction_cap=1.05, aggregation=Aggregation.seq_mean,
    ),
    "tis_sequence": LearnerConfig(
        correction=Correction.tis, correction_level=CorrectionLevel.sequence, correction_cap=1.2,
    ),
    "mis_sequence": LearnerConfig(
        correction=Correction.mis, correction_level=CorrectionLevel.sequence, correction_cap=1.2,
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
    assert stats.correction_capped_fraction == pytest.approx(want["capped"])
    if cfg.correction is not Correction.none:
        assert 0 < want["capped"] < 1, "the batch has tokens on both sides of the cap"


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


def np_corrected_loss(cur, prox, old, adv, mask, w, kind, level, cap, lo, hi):
    """The corrected policy-gradient loss and its gradient in ``cur``, token by token."""
    loss, grad = 0.0, np.zeros_like(cur)
    for i in range(cur.shape[0]):
        seq = sum(prox[i, t] - old[i, t] for t in range(cur.shape[1]) if mask[i, t])
        for t in range(cur.shape[1]):
            if not mask[i, t]:
                continue
            rho = math.exp(seq if level is CorrectionLevel.sequence else prox[i, t] - old[i, t])
            c = min(rho, cap) if kind is Correction.tis else (rho if rho <= cap else 0.0)
            r = math.exp(cur[i, t] - prox[i, t])
            unclipped, clipped = r * adv[i], min(max(r, 1 - lo), 1 + hi) * adv[i]
            loss += -c * min(unclipped, clipped) * w[i]
            if unclipped <= clipped:  # the unclipped term is the active one: d/dcur of r*A = r*A
                grad[i, t] = -c * r * adv[i] * w[i]
    return loss, grad


@pytest.mark.parametrize("kind", [Correction.tis, Correction.mis])
@pytest.mark.parametrize("level", [CorrectionLevel.token, CorrectionLevel.sequence])
def test_the_corrected_loss_and_its_gradient_match_numpy_with_a_proximal_policy_apart(kind, level):
    """Proximal logprobs apart from the current ones, so that the clip is active for some
    tokens and rho is on both sides of the cap."""
    from temper.training.grpo import grpo_token_loss

    rng = np.random.default_rng(3)
    b, t = 6, 7
    cur = -rng.uniform(0.1, 3.0, (b, t))
    prox = cur + rng.normal(0, 0.3, (b, t))
    old = prox + rng.normal(0, 0.4, (b, t))
    adv = rng.normal(0, 1, b)
    mask = rng.uniform(size=(b, t)) > 0.3
    w = rng.uniform(0.05, 0.2, b)
    cap = 1.5
    want, want_grad = np_corrected_loss(cur, prox, old, adv, mask, w, kind, level, cap, 0.2, 0.28)
    x = torch.tensor(cur, requires_grad=True)
    parts = grpo_token_loss(
        x, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_eps=0.2, clip_high=0.28,
        weights=torch.tensor(w), proximal_logprobs=torch.tensor(prox), correction=kind,
        correction_level=level, correction_cap=cap,
    )  # fmt: skip
    parts.loss.backward()
    assert parts.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert np.allclose(x.grad.numpy(), want_grad, rtol=1e-9, atol=1e-12)
    rho = np.exp(prox - old)
    if level is CorrectionLevel.sequence:
        rho = np.exp(np.where(mask, prox - old, 0).sum(1, keepdims=True)).repeat(t, 1)
    assert 0 < parts.corrected == int(((rho > cap) & mask).sum()) < int(mask.sum())
    assert parts.clipped > 0


def test_a_correction_needs_the_proximal_logprobs():
    from temper.training.grpo import grpo_token_loss

    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="proximal"):
        grpo_token_loss(z, z, torch.ones(1), torch.ones(1, 2), clip_eps=0.2, correction=Correction.tis)


def test_the_spec_sets_the_correction_and_refuses_a_cap_at_or_below_one():
    from pydantic import ValidationError

    from temper.jobspec import AlgorithmSpec

    spec = AlgorithmSpec.model_validate({"correction": {"kind": "mis", "level": "sequence", "cap": 3}})
    cfg = LearnerConfig.from_spec(spec)
    assert (cfg.correction, cfg.correction_level, cfg.correction_cap) == (
        Correction.mis, CorrectionLevel.sequence, 3.0,
    )  # fmt: skip
    assert LearnerConfig.from_spec(AlgorithmSpec()).correction is Correction.none
    with pytest.raises(ValidationError, match="cap"):
        AlgorithmSpec.model_validate({"correction": {"kind": "tis", "cap": 1.0}})
    with pytest.raises(ValidationError, match="kind"):
        AlgorithmSpec.model_validate({"correction": {"kind": "icepop"}})
