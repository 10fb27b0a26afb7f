"""The policy-gradient objective as a configuration of parts, written out token by token.

Advantages, for a group of ``G`` samples of one task with scalar rewards ``r_1..r_G``:

    group_norm     A_i = (r_i - mean(r)) / (std(r) + eps)      (population std; GRPO, DAPO)
    group_mean     A_i = r_i - mean(r)                          (Dr. GRPO)
    leave_one_out  A_i = r_i - mean_{j != i} r_j                (RLOO)

For every token ``t`` the model produced in sample ``i`` (prompt and observation
tokens are masked out):

    rho_t  = exp(log pi_theta(y_t) - log pi_behaviour(y_t))
    pg_t   = -min(rho_t * A_i, clip(rho_t, 1 - clip_low, 1 + clip_high) * A_i)
    kl_t   = k1: log pi_theta - log pi_ref;  k3: exp(d) - d - 1 with d = log pi_ref - log pi_theta
    l_t    = pg_t + kl_coef * kl_t - entropy_coef * H_t
    loss   = sum_{i,t} w_i * m_{i,t} * l_t

A mismatch correction (``Objective.correction``: TIS or MIS) weighs each token's
``pg_t`` by an importance weight of the engine's sampling, with ``log pi_prox`` the
trainer's own logprob at the weights before this step (detached):

    rho_t   = exp(log pi_prox(y_t) - log pi_behaviour(y_t))       (level token)
    rho_t   = exp(sum_t' log pi_prox(y_t') - log pi_behaviour(y_t'))  (level sequence, one per response)
    tis     c_t = min(rho_t, cap)
    mis     c_t = rho_t if rho_t <= cap else 0
    pg_t    = -c_t * min(r_t * A_i, clip(r_t, 1 - clip_low, 1 + clip_high) * A_i),
              r_t = exp(log pi_theta(y_t) - log pi_prox(y_t))

so the clipped ratio is taken against the trainer's probabilities and the engine's
enter only through ``c_t`` (the decoupled form of TIS, Yao et al. 2025, and AReaL).

With the aggregation choosing the weight ``w_i`` of each token of sample ``i``
(``n_i`` its model tokens, ``N`` those of the whole batch, ``B`` its samples):
token_mean ``1/N``, seq_mean ``1/(B n_i)``, seq_sum ``1/(B C)`` for a constant ``C``.
Weights are computed over the whole optimizer batch, so micro-batches add up to
exactly the batch's loss however it was cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from temper.jobspec import Advantage, Aggregation, Correction, CorrectionLevel, KLEstimator, Overlong

# exp() of a log-ratio above this would overflow float32; such tokens are clamped.
MAX_LOG_RATIO = 20.0
ZERO_STD = 1e-8


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every sample of a group has (numerically) the same reward: GRPO learns nothing from it."""
    if len(rewards) < 2:
        return True
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) < ZERO_STD


def advantages(
    rewards: Sequence[float], kind: Advantage = Advantage.group_norm, eps: float = 1e-4
) -> list[float]:
    """The advantages of one group's samples (see the module docstring)."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    n = r.numel()
    if n == 0:
        return []
    centred = r - r.mean()
    if kind is Advantage.group_norm:
        std = r.std(unbiased=False) if n > 1 else torch.zeros((), dtype=torch.float64)
        return (centred / (std + eps)).tolist()
    if kind is Advantage.group_mean:
        return centred.tolist()
    if kind is Advantage.leave_one_out:
        # r_i - (sum - r_i) / (n - 1) == n / (n - 1) * (r_i - mean); a lone sample has no baseline
        return (centred * (n / (n - 1))).tolist() if n > 1 else [0.0]
    raise ValueError(f"unknown advantage {kind!r}")


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` model tokens, then
    falling linearly to -1 at ``max_tokens``, and -1 beyond."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length >= max_tokens:
        return -1.0
    return (start - length) / buffer


@dataclass(frozen=True)
class Objective:
    """Which parts make up the loss (docs/training.md)."""

    advantage: Advantage = Advantage.group_norm
    aggregation: Aggregation = Aggregation.token_mean
    loss_constant: float = 1.0  # C of seq_sum
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl: KLEstimator = KLEstimator.k3
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    overlong: Overlong = Overlong.keep
    overlong_max_tokens: int = 0
    overlong_buffer: int = 0
    adv_eps: float = 1e-4
    correction: Correction = Correction.none
    correction_level: CorrectionLevel = CorrectionLevel.token
    correction_cap: float = 2.0


def sample_weights(token_counts: Sequence[int], objective: Objective) -> list[float]:
    """The per-token loss weight ``w_i`` of each sample; a sample with ``0`` model tokens
    (filtered, or nothing to score) gets 0 and does not count in ``B`` or ``N``."""
    live = [n for n in token_counts if n > 0]
    if not live:
        return [0.0] * len(token_counts)
    agg = objective.aggregation
    if agg is Aggregation.token_mean:
        total = float(sum(live))
        return [1.0 / total if n else 0.0 for n in token_counts]
    if agg is Aggregation.seq_mean:
        return [1.0 / (len(live) * n) if n else 0.0 for n in token_counts]
    if agg is Aggregation.seq_sum:
        return [1.0 / (len(live) * objective.loss_constant) if n else 0.0 for n in token_counts]
    raise ValueError(f"unknown aggregation {agg!r}")


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """Group-normalised advantages ``(r - mean) / (std + eps)`` with the population std."""
    return advantages(rewards, Advantage.group_norm, eps)


@dataclass
class LossParts:
    """Sums over the model tokens of one micro-batch. ``loss`` is already weighted (see
    :func:`sample_weights`), so micro-batches add up to the batch's loss; the other sums
    are plain, for token-mean statistics."""

    loss: torch.Tensor  # differentiable: sum_t w * mask * (pg + kl_coef * kl - entropy_coef * H)
    pg_sum: float
    kl_sum: float
    clipped: float  # tokens where the clip bound is the active term
    ratio_sum: float
    abs_log_ratio_sum: float
    tokens: float
    entropy_sum: float = 0.0
    correction_sum: float = 0.0  # of c_t (each token's correction weight; 1 without one)
    corrected: float = 0.0  # tokens whose rho passed the cap (truncated or masked)


def grpo_token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    normalizer: float = 1.0,
    clip_high: float | None = None,
    weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl: KLEstimator = KLEstimator.k3,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    proximal_logprobs: torch.Tensor | None = None,
    correction: Correction = Correction.none,
    correction_level: CorrectionLevel = CorrectionLevel.token,
    correction_cap: float = 2.0,
) -> LossParts:
    """``logprobs``/``behaviour_logprobs``/``ref_logprobs``/``entropy``/``mask``: ``[B, T]``;
    ``advantages`` and ``weights`` (per-token weight of each row): ``[B]``; without
    ``weights`` every token weighs ``1 / normalizer``. ``clip_eps`` is the lower bound,
    ``clip_high`` the upper one (default: the same). Masked positions contribute
    nothing, not even NaN. A ``correction`` other than none needs ``proximal_logprobs``
    (the module docstring)."""
    high = clip_eps if clip_high is None else clip_high
    m = mask.bool()
    mf = m.to(logprobs.dtype)
    corrected = correction is not Correction.none
    if corrected and proximal_logprobs is None:
        raise ValueError(f"correction {correction} needs the proximal logprobs")
    anchor = behaviour_logprobs if proximal_logprobs is None or not corrected else proximal_logprobs.detach()
    log_ratio = torch.where(m, logprobs - anchor, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1).expand_as(ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    pg = -torch.minimum(unclipped, clipped)
    weight_c = torch.ones_like(logprobs)
    past = torch.zeros_like(m)
    if corrected:
        with torch.no_grad():
            log_rho = torch.where(m, anchor - behaviour_logprobs, torch.zeros_like(logprobs))
            if correction_level is CorrectionLevel.sequence:
                log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
            log_cap = math.log(correction_cap)
            past = (log_rho > log_cap) & m
            rho = torch.exp(log_rho.clamp(max=log_cap))  # past the cap: cap (tis) or 0 (mis)
            weight_c = torch.where(past, torch.zeros_like(rho), rho) if correction is Correction.mis else rho
        pg = pg * weight_c
    per_token = pg
    kl_sum = 0.0
    if ref_logprobs is not None and kl is not KLEstimator.none:
        d = torch.where(m, ref_logprobs - logprobs, torch.zeros_like(logprobs)).clamp(
            -MAX_LOG_RATIO, MAX_LOG_RATIO
        )
        kl_t = -d if kl is KLEstimator.k1 else torch.exp(d) - d - 1.0
        kl_sum = float((kl_t * mf).sum().detach())
        if kl_coef:
            per_token = per_token + kl_coef * kl_t
    entropy_sum = 0.0
    if entropy is not None:
        ent = torch.where(m, entropy, torch.zeros_like(entropy))
        entropy_sum = float((ent * mf).sum().detach())
        if entropy_coef:
            per_token = per_token - entropy_coef * ent
    if weights is None:
        w = mf / normalizer
    else:
        w = mf * weights.to(logprobs.dtype).unsqueeze(-1)
    loss = (per_token * w).sum()
    with torch.no_grad():
        bound = ((adv > 0) & (ratio > 1.0 + high)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        # the statistics' ratio is against the engine's logprobs, with a correction too
        behaviour_log_ratio = log_ratio
        if corrected:
            behaviour_log_ratio = torch.where(m, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
            behaviour_log_ratio = behaviour_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        behaviour_ratio = torch.exp(behaviour_log_ratio)
        return LossParts(
            loss=loss,
            pg_sum=float((pg * mf).sum()),
            kl_sum=kl_sum,
            clipped=float((bound & m).sum()),
            ratio_sum=float((behaviour_ratio * mf).sum()),
            abs_log_ratio_sum=float((behaviour_log_ratio.abs() * mf).sum()),
            tokens=float(mf.sum()),
            entropy_sum=entropy_sum,
            correction_sum=float((weight_c * mf).sum()),
            corrected=float(past.sum()),
        )
