"""Direct preference optimisation (Rafailov et al. 2023) on (chosen, rejected) pairs.

With ``s = log pi_theta(y | x)`` summed over a response's trained tokens and ``s_ref``
the same under the frozen reference policy, for each pair:

    loss = -log sigmoid(beta * ((s_chosen - s_ref_chosen) - (s_rejected - s_ref_rejected)))

averaged over the pairs of the step. The reference is the one the RL trainer keeps for
its KL term: a frozen copy of the initial weights, or the model with its LoRA adapter
switched off (:meth:`temper.training.Learner.step_pairs`). Not yet a job: the spec
refuses ``algorithm.name: dpo`` until pairs can be uploaded and scheduled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention

Encoded = tuple[list[int], list[bool]]


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Each pair's loss (see the module docstring), from sequence logprobs."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin)


def pair_micro_batches(
    pairs: Sequence[tuple[Encoded, Encoded]], token_budget: int
) -> list[list[tuple[Encoded, Encoded]]]:
    """Pairs grouped so a micro-batch's padded size (rows x longest row) stays within
    ``token_budget``, both rows of a pair always together (a pair over it goes alone)."""
    ordered = sorted(pairs, key=lambda p: max(len(p[0][0]), len(p[1][0])), reverse=True)
    out: list[list[tuple[Encoded, Encoded]]] = []
    current: list[tuple[Encoded, Encoded]] = []
    width = 0
    for pair in ordered:
        w = max(width, len(pair[0][0]), len(pair[1][0]))
        if current and w * 2 * (len(current) + 1) > token_budget:
            out.append(current)
            current, w = [], max(len(pair[0][0]), len(pair[1][0]))
        current.append(pair)
        width = w
    if current:
        out.append(current)
    return out
