"""The learner's memory, planned before the first step.

:func:`estimate` adds up what one trainer process holds for a job: fp32 master weights
(4 bytes a parameter), fp32 gradients and AdamW's two moments for the trainable ones
(4 + 8 bytes), the frozen reference policy when the KL term needs one, and the
activations of one micro-batch at the moment they peak. Weights, gradients and
optimizer state are exact counts; activations are a model of what is alive at each
moment of a micro-batch's forward and backward, and the largest of these is taken:

- the output layer's backward (usually the peak at real vocabularies): the fp32
  log-softmax over the scored positions kept for the backward, and the gradient of the
  picked logprobs that scatters into a zeroed copy of it (3 x 4 bytes a vocabulary
  entry a scored position); the KL reference's forward peaks alike (the policy's kept
  log-softmax beside the reference's logits and log-softmax); under bf16 autocast, the
  output layer's bf16 weights kept for its backward;
- the end of the forward: fp32 logits and log-softmax, and under autocast a bf16 copy
  of every trainable weight (autocast caches them until the forward ends);
- the backward through the decoder layers: one layer's activations (recomputed, with
  gradient checkpointing) and, for tied embeddings, the output layer's weight gradient,
  held until the embedding's arrives;
- the embedding's backward: its dense weight gradient (tied: beside the output layer's
  and their sum, 3 x 4 bytes a weight).

Decoder layers keep, per token, about ``8 h + 2 kv + 4 i`` elements each (h the hidden
size, kv the key/value width, i the MLP width); with gradient checkpointing only each
layer's input, which stays fp32 under autocast (the embedding's output is fp32 and every
residual add keeps it so), plus the one layer being recomputed. Only scored positions
go through the output layer (``temper.training.learner.completion_logprobs``): the
learner plans for the worst case, every padded token scored; ``scored_tokens`` gives
the real count (what ``bench/gpu_check.py`` compares with a GPU's peak).

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
    tied: bool = False  # the output layer's weight is the input embedding's
    head_trainable: bool = False  # the output layer's weight gets a gradient
    embedding_trainable: bool = False  # the input embedding's weight gets a gradient


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
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    emb_w = getattr(emb, "weight", None)
    head_w = getattr(head, "weight", None)
    return Shape(
        params=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        layers=int(getattr(cfg, "num_hidden_layers", 0) or 0),
        hidden=hidden,
        kv=kv_heads * head_dim,
        intermediate=int(getattr(cfg, "intermediate_size", 0) or 4 * hidden),
        vocab=int(getattr(cfg, "vocab_size", 0) or 0),
        tied=head_w is not None and head_w is emb_w,
        head_trainable=bool(head_w is not None and head_w.requires_grad),
        embedding_trainable=bool(emb_w is not None and emb_w.requires_grad),
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
    scored_tokens: int | None = None,
    gradient_checkpointing: bool = False,
    bf16: bool = False,
    reference: bool = False,
    ranks: int = 1,
) -> MemoryEstimate:
    """What one process holds for micro-batches of ``micro_batch_tokens`` padded tokens,
    of which ``scored_tokens`` (default: all) go through the output layer. With
    ``ranks`` > 1 (FSDP2), the weights, gradients and AdamW state are this rank's shard
    (a ``ranks``-th, rounded up), plus two decoder layers' whole weights, gathered for
    the forward or backward of one while the next is prefetched; the reference policy
    stays whole on every rank, activations per rank."""
    tokens = micro_batch_tokens
    scored = tokens if scored_tokens is None else min(scored_tokens, tokens)
    act_bytes = 2 if bf16 else 4
    per_layer_token = 8 * shape.hidden + 2 * shape.kv + 4 * shape.intermediate
    if gradient_checkpointing:
        kept = 4 * tokens * shape.layers * shape.hidden  # each layer's (fp32) input
        layer = tokens * per_layer_token * act_bytes  # the one being recomputed
    else:
        kept, layer = tokens * shape.layers * per_layer_token * act_bytes, 0
    head = shape.vocab * shape.hidden
    head_copy = 2 * head if bf16 else 0  # the output layer's bf16 weights, kept for its backward
    logits = 4 * scored * shape.vocab  # one fp32 copy over the scored positions
    held = 4 * head if shape.tied and shape.head_trainable else 0
    cast = 2 * shape.trainable + (0 if shape.head_trainable else head_copy) if bf16 else 0
    if held:
        embedding = 3 * held
    else:
        embedding = 4 * head if shape.embedding_trainable else 0
    activations = max(
        kept + 3 * logits + head_copy,  # the output layer's backward (or the reference's forward)
        kept + 2 * logits + cast,  # the end of the forward
        kept + layer + held,  # the backward through the layers
        embedding,  # the embedding's backward
    )
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
        adapter = replace(shape, trainable=lora, head_trainable=False, embedding_trainable=False)
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
