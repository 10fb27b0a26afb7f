"""From trajectories to padded tensors.

A :class:`Sample` is one trajectory flattened: every token id, a mask that is True on
the model's own tokens, the behaviour logprob of each token and the policy version that
sampled it (a partial rollout holds several), the sample's advantage and the per-token
weight its aggregation gives it (set by the learner for the whole batch). :func:`micro_batches` packs samples of similar length under a padded-token
budget; :func:`collate` right-pads one micro-batch into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from temper.jobspec import Overlong
from temper.training.grpo import Objective, advantages, is_zero_variance, overlong_penalty
from temper.trajectory import NOT_SAMPLED, Trajectory


@dataclass
class Sample:
    ids: list[int]
    mask: list[bool]
    behaviour_logprobs: list[float]
    advantage: float
    reward: float
    behaviour_version: int = 0
    episode_id: str = ""
    group_id: str = ""
    filtered: bool = False  # an overlong response under ``overlong: filter``: no loss
    weight: float = 0.0  # per-token loss weight (temper.training.grpo.sample_weights)
    # the version that sampled each token (NOT_SAMPLED where masked); empty: every model
    # token is ``behaviour_version``'s
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.mask) == len(self.behaviour_logprobs)):
            raise ValueError("ids, mask and behaviour_logprobs must have the same length")
        if self.versions and len(self.versions) != len(self.ids):
            raise ValueError("versions must have one entry per token")

    def token_versions(self) -> list[int]:
        """The version that sampled each token, :data:`NOT_SAMPLED` where masked."""
        if self.versions:
            return self.versions
        return [self.behaviour_version if m else NOT_SAMPLED for m in self.mask]

    def model_versions(self) -> list[int]:
        """The version of each model token (the mask's True positions), in order."""
        return [v for v, m in zip(self.token_versions(), self.mask, strict=True) if m]

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    @property
    def scored_tokens(self) -> int:
        """Model tokens that enter the loss (token 0 has no context; a filtered sample has none)."""
        return 0 if self.filtered else sum(self.mask[1:])


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    completion_mask: torch.Tensor  # [B, T] bool: the model's own tokens
    behaviour_logprobs: torch.Tensor  # [B, T] float32, 0 where masked
    advantages: torch.Tensor  # [B] float32
    weights: torch.Tensor  # [B] float32: per-token loss weight of each row
    token_versions: torch.Tensor  # [B, T] long: the version that sampled each token, NOT_SAMPLED elsewhere

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def samples_from_groups(
    groups: Sequence[Sequence[Trajectory]],
    *,
    eps: float = 1e-4,
    skip_zero_variance: bool = True,
    objective: Objective | None = None,
) -> tuple[list[Sample], int]:
    """One :class:`Sample` per token sequence of each trajectory (one, except an agent's
    whose history was rewritten: ``Trajectory.samples``), each with its trajectory's
    advantage (``objective.advantage``, after any overlong penalty on the reward, counted
    over all its sequences); returns the samples and how many groups were dropped for zero
    reward variance (of the rewards as trained on, penalties included). ``eps`` is used
    when no ``objective`` is given."""
    obj = objective or Objective(adv_eps=eps)
    samples: list[Sample] = []
    skipped = 0
    for group in groups:
        flat = [t.samples() for t in group]
        rewards = [t.reward for t in group]
        lengths = [sum(sum(mask) for _, mask, _ in seqs) for seqs in flat]
        if obj.overlong is Overlong.penalty:
            rewards = [
                r + overlong_penalty(n, obj.overlong_max_tokens, obj.overlong_buffer)
                for r, n in zip(rewards, lengths, strict=True)
            ]
        if skip_zero_variance and is_zero_variance(rewards):
            skipped += 1
            continue
        advs = advantages(rewards, obj.advantage, obj.adv_eps)
        for traj, seqs, adv, n in zip(group, flat, advs, lengths, strict=True):
            for (ids, mask, logprobs), versions in zip(seqs, traj.sample_versions(), strict=True):
                samples.append(
                    Sample(
                        ids,
                        mask,
                        logprobs,
                        adv,
                        traj.reward,
                        traj.behaviour_version,
                        traj.episode_id,
                        traj.group_id,
                        filtered=obj.overlong is Overlong.filter and n >= obj.overlong_max_tokens,
                        versions=versions,
                    )
                )
    return samples, skipped


def micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Split into micro-batches of similar length whose padded size (rows x longest row)
    stays within ``token_budget`` (a sample longer than the budget goes alone)."""
    ordered = sorted(samples, key=lambda s: len(s.ids), reverse=True)
    out: list[list[Sample]] = []
    current: list[Sample] = []
    width = 0
    for s in ordered:
        w = max(width, len(s.ids))
        if current and w * (len(current) + 1) > token_budget:
            out.append(current)
            current, w = [], len(s.ids)
        current.append(s)
        width = w
    if current:
        out.append(current)
    return out


def collate(samples: Sequence[Sample], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """Right-pad samples into tensors on ``device``."""
    width = max(len(s.ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    comp = torch.zeros((n, width), dtype=torch.bool)
    old = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), NOT_SAMPLED, dtype=torch.long)
    for i, s in enumerate(samples):
        k = len(s.ids)
        ids[i, :k] = torch.tensor(s.ids, dtype=torch.long)
        attn[i, :k] = 1
        comp[i, :k] = torch.tensor(s.mask, dtype=torch.bool)
        old[i, :k] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        versions[i, :k] = torch.tensor(s.token_versions(), dtype=torch.long)
        if s.filtered:
            comp[i] = False
    # The first token has no context, so it can never be scored (token_logprobs gives 0 there).
    comp[:, 0] = False
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    weights = torch.tensor([s.weight for s in samples], dtype=torch.float32)
    return Batch(
        ids.to(device),
        attn.to(device),
        comp.to(device),
        old.to(device),
        adv.to(device),
        weights.to(device),
        versions.to(device),
    )
