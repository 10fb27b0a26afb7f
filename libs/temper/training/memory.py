"""The learner's memory, planned before the first step.

:func:`estimate` adds up what one trainer process holds for a job: fp32 master weights
(4 bytes a parameter), fp32 gradients and AdamW's two moments for the trainable ones
(4 + 8 bytes), the frozen reference policy when the KL term needs one, and the
activations one micro-batch keeps for its backward pass. Weights, gradients and
optimizer state are exact counts; activations are a model of a decoder layer (its
saved tensors per token: about ``8 h + 2 kv + 4 i`` elements, h the hidden size, kv
the key/value width, i the MLP width; with gradient checkpointing only each layer's
input, plus one layer recomputed at a time) and of the output layer's fp32 logits on
the scored positions (logits, log-softmax and their gradient).

:func:`check_fits` refuses a plan above the limit with the figures and the changes
that would make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


class MemoryPlanError(ValueError):
    """The job cannot fit; the message carries the estimate and what would make it fit."""


@dataclass(frozen=True)
class Shape:
    params: int
    trainable: int
    layers: int
    hidden: int
    kv: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int  # one micro-batch
    micro_batch_tokens: int
    gradient_checkpointing: bool
    bf16: bool
    ranks: int = 1  # FSDP: weights, gradients and optimizer state are this rank's shard

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.activations

    def describe(self) -> str:
        parts = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("reference", self.reference),
            ("activations", self.activations),
        ]
        body = ", ".join(f"{name} {size(b)}" for name, b in parts)
        how = f"{self.micro_batch_tokens} tokens/micro-batch, checkpointing {'on' if self.gradient_checkpointing else 'off'}, {'bf16' if self.bf16 else 'fp32'} activations"
        if self.ranks > 1:
            how += f", per rank of {self.ranks} (FSDP)"
        return f"{size(self.total)} ({body}; {how})"


def model_shape(model: torch.nn.Module) -> Shape:
    cfg: Any = getattr(model, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if hidden else 0))
    return Shape(
        params=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        layers=int(getattr(cfg, "num_hidden_layers", 0) or 0),
        hidden=hidden,
        kv=kv_heads * head_dim,
        intermediate=int(getattr(cfg, "intermediate_size", 0) or 4 * hidden),
        vocab=int(getattr(cfg, "vocab_size", 0) or 0),
    )


def lora_trainable(model: torch.nn.Module, rank: int) -> int:
    """Trainable parameters of a rank-``rank`` adapter on every linear layer but the output one."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return sum(
        rank * (m.in_features + m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )


def estimate(
    shape: Shape,
    *,
    micro_batch_tokens: int,
    gradient_checkpointing: bool = False,
    bf16: bool = False,
    reference: bool = False,
    ranks: int = 1,
) -> MemoryEstimate:
    """What one process holds. With ``ranks`` > 1 (FSDP2), the weights, gradients and
    AdamW state are this rank's shard (a ``ranks``-th, rounded up), plus two decoder
    layers' whole weights, gathered for the forward or backward of one while the next is
    prefetched; the reference policy stays whole on every rank, activations per rank."""
    act_bytes = 2 if bf16 else 4
    per_layer_token = 8 * shape.hidden + 2 * shape.kv + 4 * shape.intermediate
    if gradient_checkpointing:
        layers = shape.layers * shape.hidden + per_layer_token
    else:
        layers = shape.layers * per_layer_token
    activations = micro_batch_tokens * (layers * act_bytes + 3 * shape.vocab * 4)
    gathered = 2 * 4 * (shape.params // max(shape.layers, 1)) if ranks > 1 else 0
    return MemoryEstimate(
        weights=-(-4 * shape.params // ranks) + gathered,
        gradients=-(-4 * shape.trainable // ranks),
        optimizer=-(-8 * shape.trainable // ranks),
        reference=4 * shape.params if reference else 0,
        activations=activations,
        micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=gradient_checkpointing,
        bf16=bf16,
        ranks=ranks,
    )


def alternatives(shape: Shape, plan: MemoryEstimate, *, lora: int) -> list[tuple[str, MemoryEstimate]]:
    """The plan with one setting changed at a time (for the start-up report and the refusal)."""

    def variant(of: Shape = shape, **changes: Any) -> MemoryEstimate:
        kw: dict[str, Any] = {
            "micro_batch_tokens": plan.micro_batch_tokens,
            "gradient_checkpointing": plan.gradient_checkpointing,
            "bf16": plan.bf16,
            "reference": plan.reference > 0,
            "ranks": plan.ranks,
        }
        return estimate(of, **{**kw, **changes})

    out = []
    if not plan.gradient_checkpointing:
        out.append(("algorithm.gradient_checkpointing: true", variant(gradient_checkpointing=True)))
    if plan.micro_batch_tokens > 512:
        half = plan.micro_batch_tokens // 2
        out.append((f"algorithm.max_tokens_per_microbatch: {half}", variant(micro_batch_tokens=half)))
    if lora and shape.trainable > lora:
        # an adapter's reference is the base model itself: no copy
        adapter = replace(shape, trainable=lora)
        out.append((f"a LoRA adapter (rank 16, {lora} parameters)", variant(adapter, reference=False)))
    return out


def check_fits(
    shape: Shape, plan: MemoryEstimate, limit_bytes: int, *, lora: int = 0, device: str = "cpu"
) -> None:
    """Raise :class:`MemoryPlanError` when ``plan`` exceeds ``limit_bytes``."""
    if plan.total <= limit_bytes:
        return
    fixes = [f"{what} -> {size(alt.total)}" for what, alt in alternatives(shape, plan, lora=lora)]
    fits = [
        f
        for f, (_, alt) in zip(fixes, alternatives(shape, plan, lora=lora), strict=True)
        if alt.total <= limit_bytes
    ]
    raise MemoryPlanError(
        f"the job needs about {plan.describe()}, more than the {size(limit_bytes)} available on {device}; "
        + (f"it would fit with {'; or '.join(fits)}" if fits else f"single changes do not make it fit: {'; '.join(fixes) or 'none'}")
        + " (a larger device, or several)"
    )  # fmt: skip
