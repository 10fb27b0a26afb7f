"""Data parallelism over a sharded model: FSDP2 (``torch.distributed.fsdp.fully_shard``)
under ``torchrun``, on GPUs with NCCL or on CPUs with gloo.

Every rank holds a shard of the weights, gradients and AdamW state. A step: every rank
gets the same optimizer batch, computes the loss weights over all of it
(:meth:`Learner.backward` with ``batch=``), and trains on its own share
(:func:`share`). Because the weights are the whole batch's, the ranks' gradients *sum*
to the single-process gradient (FSDP averages, so the loss is scaled by the world size).
Gradient clipping uses the global norm, and every rank steps its shard of AdamW.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

from temper.training.batch import Sample
from temper.training.learner import Learner


def shard(learner: Learner) -> None:
    """Shard ``learner``'s model (each decoder layer, then the rest) and rebuild its
    AdamW over the sharded parameters. Call after ``init_process_group``, before any step."""
    model = learner.model
    decoder: Any = getattr(model, "get_decoder", lambda: None)()
    for layer in getattr(decoder, "layers", []):
        fully_shard(layer)
    fully_shard(model)
    # FSDP averages gradients over ranks (a sum with a divide factor would need PREMUL_SUM,
    # which gloo lacks): scaling the loss by the world size makes the average the sum
    learner.loss_scale = float(torch.distributed.get_world_size())
    if learner.config.entropy_coef:
        raise ValueError("the entropy bonus is not available on a sharded model yet")
    learner.full_forward = True
    cfg = learner.config
    learner.optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.learning_rate,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
    )


def share(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
    """Rank ``rank``'s samples: longest first, each to the rank with the fewest tokens so far."""
    loads = [0] * world
    mine: list[Sample] = []
    for s in sorted(samples, key=lambda s: len(s.ids), reverse=True):
        r = loads.index(min(loads))
        loads[r] += len(s.ids)
        if r == rank:
            mine.append(s)
    return mine


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm from ``clip_grad_norm_`` over sharded parameters (a DTensor) as a float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
