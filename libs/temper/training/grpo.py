"""The GRPO objective, written out token by token.

For a group of ``G`` samples of one task with scalar rewards ``r_1..r_G``:

    A_i = (r_i - mean(r)) / (std(r) + eps)          (population std)

For every token ``t`` the model produced in sample ``i`` (prompt and observation
tokens are masked out):

    rho_t  = exp(log pi_theta(y_t) - log pi_behaviour(y_t))
    pg_t   = -min(rho_t * A_i, clip(rho_t, 1 - clip_eps, 1 + clip_eps) * A_i)
    kl_t   = exp(log pi_ref(y_t) - log pi_theta(y_t)) - (log pi_ref(y_t) - log pi_theta(y_t)) - 1   (k3)
    loss   = sum_t mask_t * (pg_t + kl_coef * kl_t) / sum_t mask_t

The sum runs over every token of every sample of the optimizer batch (token-level
averaging), so a long answer weighs as much per token as a short one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# exp() of a log-ratio above this would overflow float32; such tokens are clamped.
MAX_LOG_RATIO = 20.0
ZERO_STD = 1e-8


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True when every sample of a group has (numerically) the same reward: GRPO learns nothing from it."""
    if len(rewards) < 2:
        return True
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) < ZERO_STD


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """Group-normalised advantages ``(r - mean) / (std + eps)`` with the population std."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    if r.numel() == 0:
        return []
    std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


@dataclass
class LossParts:
    """Sums over the model tokens of one micro-batch; divided by the step's token count
    by the caller, so micro-batches add up to the token-level mean."""

    loss: torch.Tensor  # differentiable: sum_t mask * (pg + kl_coef * kl) / normalizer
    pg_sum: float
    kl_sum: float
    clipped: float  # tokens where the clip bound is the active term
    ratio_sum: float
    abs_log_ratio_sum: float
    tokens: float


def grpo_token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """``logprobs``/``behaviour_logprobs``/``ref_logprobs``/``mask``: ``[B, T]``;
    ``advantages``: ``[B]``. Masked positions contribute nothing, not even NaN."""
    m = mask.bool()
    mf = m.to(logprobs.dtype)
    log_ratio = torch.where(m, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1).expand_as(ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    per_token = pg
    kl_sum = 0.0
    if ref_logprobs is not None:
        d = torch.where(m, ref_logprobs - logprobs, torch.zeros_like(logprobs)).clamp(
            -MAX_LOG_RATIO, MAX_LOG_RATIO
        )
        kl = torch.exp(d) - d - 1.0
        kl_sum = float((kl * mf).sum().detach())
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = (per_token * mf).sum() / normalizer
    with torch.no_grad():
        bound = ((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        return LossParts(
            loss=loss,
            pg_sum=float((pg * mf).sum()),
            kl_sum=kl_sum,
            clipped=float((bound & m).sum()),
            ratio_sum=float((ratio * mf).sum()),
            abs_log_ratio_sum=float((log_ratio.abs() * mf).sum()),
            tokens=float(mf.sum()),
        )
