"""The logprob canary: the behaviour logprobs an inference engine reported, against the
trainer's own recomputation of the same tokens under the same weights.

For a token sampled by the version the learner holds (each token's own version: with
partial rollouts one trajectory holds tokens of several) *and* before the learner changed
those weights (the first optimizer step after the version was published or loaded), the
two are the same number up to engine noise: the ratio of the policy-gradient loss is 1.
A gap past that noise means the engine served other weights than the version it named,
or computes something else (another dtype, a broken kernel, a stale output layer), and the
step would learn from off-policy data labelled on-policy. Measured noise (``make
bench-mismatch``, docs/inference.md): the CPU engine and vLLM in fp32 stay within 7.6e-6 per
token; vLLM with bf16 weights has a mean of 0.026 and a max of 0.38. The default tolerance,
1e-4 per token, is 13x the worst fp32 token seen; a bf16 deployment sets its own
(``algorithm.mismatch.tolerance``, e.g. 0.5, above the bf16 max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Mismatch:
    """|recomputed - behaviour| over the tokens checked: how many, their sum and max, and how
    many were past the tolerance."""

    checked: int = 0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    over: int = 0

    @property
    def mean(self) -> float:
        return self.sum_abs / self.checked if self.checked else 0.0

    @property
    def share_over(self) -> float:
        return self.over / self.checked if self.checked else 0.0

    def failed(self, max_share: float) -> bool:
        """More than ``max_share`` of the checked tokens were past the tolerance (nothing
        checked is not a failure: it is reported as ``checked == 0``)."""
        return self.checked > 0 and self.share_over > max_share

    def add(self, other: Mismatch) -> None:
        self.checked += other.checked
        self.sum_abs += other.sum_abs
        self.max_abs = max(self.max_abs, other.max_abs)
        self.over += other.over


def compare(
    recomputed: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    sampled_here: torch.Tensor,
    *,
    tolerance: float,
) -> Mismatch:
    """``recomputed``/``behaviour``: ``[B, T]`` logprobs; ``mask``: ``[B, T]`` the model's own
    tokens; ``sampled_here``: ``[B, T]`` the tokens sampled by the weights ``recomputed``
    came from (or ``[B]``: whole rows)."""
    here = sampled_here.bool()
    m = mask.bool() & (here if here.dim() == 2 else here.unsqueeze(1))
    if not bool(m.any()):
        return Mismatch()
    gap = (recomputed.detach().float() - behaviour.float()).abs()[m]
    return Mismatch(
        checked=int(gap.numel()),
        sum_abs=float(gap.sum()),
        max_abs=float(gap.max()),
        over=int((gap > tolerance).sum()),
    )
