"""The :class:`Learner`: a policy model, its AdamW optimizer and the GRPO step.

``step(groups)`` takes groups of trajectories (same task, several samples), computes
group-normalised advantages, and makes one optimizer step over all of them:
micro-batches of similar length are forwarded and backpropagated in turn and their
gradients accumulate, normalised by the model-token count of the whole step, so the
result does not depend on how the batch was split. Gradients are clipped by global
norm before AdamW.

The same code runs on CPU and GPU: on CUDA the forward runs under bf16 autocast
while weights, gradients and optimizer state stay float32.

Checkpoints of one process are two safetensors files: the weights (``<key>``, the format
``temper.policy.load_weights`` and the inference gateway read) and the optimizer
state (``<key minus .safetensors>.optimizer.safetensors``) with step and version in
its metadata; no pickle is involved. A sharded learner (FSDP2 under torchrun) also saves
its state with ``torch.distributed.checkpoint`` (``temper.training.distributed``), whose
``.metadata`` file is a pickle: written and read only by the trainer's own ranks, from
the object store's version prefix, never from a tenant.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from temper import cores
from temper.jobspec import (
    Advantage,
    Aggregation,
    Algorithm,
    AlgorithmSpec,
    Correction,
    CorrectionLevel,
    KLEstimator,
    LoraSpec,
    OnMismatch,
    Overlong,
    Precision,
)
from temper.logs import log_event
from temper.policy import load_weights, position_ids_from_mask, save_weights, token_logprobs
from temper.settings.trainer import Device, TrainerSettings
from temper.storage import ObjectStore
from temper.training.batch import Sample, collate, micro_batches, samples_from_groups
from temper.training.canary import Mismatch, compare
from temper.training.grpo import Objective, grpo_token_loss, sample_weights
from temper.training.lora import (
    SharedBase,
    adapter_state,
    apply_lora,
    load_adapter_state,
    reference_off,
    save_adapter,
)
from temper.training.memory import (
    GiB,
    MemoryEstimate,
    alternatives,
    check_fits,
    estimate,
    lora_trainable,
    model_shape,
    size,
)
from temper.training.prompts import can_share, prompt_micro_batches, shared_prompt_logprobs
from temper.trajectory import Trajectory

OPTIMIZER_FORMAT = "temper-adamw-v1"
log = logging.getLogger("temper.training")

P = ParamSpec("P")
R = TypeVar("R")


def on_adapter(method: Callable[Concatenate[Learner, P], R]) -> Callable[Concatenate[Learner, P], R]:
    """Run a method that uses the model with this learner's adapter active (on a shared
    base model, see :class:`temper.training.lora.SharedBase`)."""

    @functools.wraps(method)
    def wrapper(self: Learner, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.adapter_active():
            return method(self, *args, **kwargs)

    return wrapper


def pick_device(device: Device | str = Device.auto) -> torch.device:
    """``auto``: the first CUDA device when one is visible, else the CPU."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("TEMPER_TRAINER__DEVICE=cuda but no CUDA device is visible")
    return torch.device(name)


def policy_entropy(logp: torch.Tensor, grad: bool) -> torch.Tensor:
    """``-sum(p log p)`` over the last axis. Measured only (no ``grad``), it is made in place
    in one extra copy of ``logp``, so measuring it on every step costs no more memory than
    the forward's end already holds (``temper.training.memory`` plans two copies)."""
    if grad and torch.is_grad_enabled():
        return -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        p = logp.exp()
        return -p.mul_(logp).sum(-1)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    entropy: list[torch.Tensor] | None = None,
    entropy_grad: bool = True,
) -> torch.Tensor:
    """``token_logprobs(model, ids, attention, completion)`` computed only where it is
    needed: the decoder runs on every token, but the output projection and the softmax
    only on the positions that predict a model token. For real vocabularies (10^5
    entries) this is most of the memory and a large share of the compute of a step
    with long prompts and observations. Falls back to ``token_logprobs`` for models
    without a separate decoder and output layer. With ``entropy`` (a list), the entropy
    of the policy at each scored position is appended to it, shaped like the result
    (differentiable only with ``entropy_grad``: without the bonus it is only measured)."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if decoder is None or head is None:
        return token_logprobs(
            model, input_ids, attention_mask, completion_mask, entropy=entropy, entropy_grad=entropy_grad
        )
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    am = attention_mask.bool()
    # position t is scored from the hidden state at t-1, if both tokens are real and t is the model's
    scored = completion_mask[:, 1:].bool() & am[:, 1:] & am[:, :-1]
    # unnamed logits: freed once the log-softmax (which its backward needs) is made
    logp = torch.log_softmax(head(hidden[:, :-1][scored]).float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:][scored].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device)
    index = scored.nonzero(as_tuple=True)
    if entropy is not None:
        entropy.append(
            torch.zeros_like(out).index_put((index[0], index[1] + 1), policy_entropy(logp, entropy_grad))
        )
    return out.index_put((index[0], index[1] + 1), picked)


def optimizer_key(weights_key: str) -> str:
    """Where the optimizer state of the checkpoint at ``weights_key`` lives."""
    base = weights_key[: -len(".safetensors")] if weights_key.endswith(".safetensors") else weights_key
    return base + ".optimizer.safetensors"


@dataclass
class LearnerConfig:
    learning_rate: float = 1e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adv_eps: float = 1e-4
    skip_zero_variance: bool = True
    micro_batch_tokens: int = 8192
    bf16: bool = True
    # the objective's parts (temper.training.grpo.Objective); clip_eps is the lower clip bound
    advantage: Advantage = Advantage.group_norm
    aggregation: Aggregation = Aggregation.token_mean
    loss_constant: float = 1.0
    clip_high: float | None = None  # default: clip_eps
    kl_estimator: KLEstimator = KLEstimator.k3
    entropy_coef: float = 0.0
    overlong: Overlong = Overlong.keep
    overlong_max_tokens: int = 0
    overlong_buffer: int = 0
    gradient_checkpointing: bool = False
    share_prompts: bool = True  # run each group's prompt once per micro-batch (temper.training.prompts)
    memory_limit_gb: float | None = None  # default: the CUDA device's memory; none on CPU
    lora: LoraSpec | None = None  # train a LoRA adapter; None: every weight
    # the logprob canary (temper.training.canary; the spec's algorithm.mismatch)
    mismatch_tolerance: float = 1e-4
    mismatch_max_share: float = 0.01
    on_mismatch: OnMismatch = OnMismatch.flag
    # train/inference mismatch correction (the spec's algorithm.correction; temper.training.grpo)
    correction: Correction = Correction.none
    correction_level: CorrectionLevel = CorrectionLevel.token
    correction_cap: float = 2.0
    # supervised fine-tuning (algorithm.name sft): the loss is the token-mean negative
    # log-likelihood of the masked tokens; no advantage, ratio, reference or canary
    sft: bool = False
    # DPO (temper.training.dpo; algorithm.name dpo): beta, and a frozen reference as the KL
    # term's (a copy of the initial weights, or the adapter off)
    dpo_beta: float | None = None
    # a reward model (algorithm.name reward_model; temper.training.reward_model): the model is
    # a sequence classifier with one output, trained by the Bradley-Terry loss on pairs
    reward_model: bool = False

    def objective(self) -> Objective:
        return Objective(
            advantage=self.advantage,
            aggregation=self.aggregation,
            loss_constant=self.loss_constant,
            clip_low=self.clip_eps,
            clip_high=self.clip_eps if self.clip_high is None else self.clip_high,
            kl=self.kl_estimator,
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            overlong=self.overlong,
            overlong_max_tokens=self.overlong_max_tokens,
            overlong_buffer=self.overlong_buffer,
            adv_eps=self.adv_eps,
            correction=self.correction,
            correction_level=self.correction_level,
            correction_cap=self.correction_cap,
        )

    @classmethod
    def from_spec(cls, algorithm: AlgorithmSpec, settings: TrainerSettings | None = None) -> LearnerConfig:
        """The job's algorithm settings plus the trainer process's own knobs."""
        s = settings or TrainerSettings.model_validate({})
        a = algorithm
        if a.name in (Algorithm.sft, Algorithm.dpo, Algorithm.reward_model):
            return cls(
                learning_rate=a.learning_rate,
                max_grad_norm=a.max_grad_norm,
                weight_decay=s.weight_decay,
                micro_batch_tokens=a.max_tokens_per_microbatch or s.micro_batch_tokens,
                bf16=s.bf16 if a.precision is None else a.precision is Precision.bf16,
                gradient_checkpointing=a.gradient_checkpointing,
                memory_limit_gb=s.memory_limit_gb,
                lora=a.lora,
                sft=a.name is Algorithm.sft,
                dpo_beta=a.beta if a.name is Algorithm.dpo else None,
                reward_model=a.name is Algorithm.reward_model,
            )
        if a.aggregation is Aggregation.seq_sum and a.loss_constant is None:
            raise ValueError("aggregation seq_sum needs algorithm.loss_constant")
        if a.overlong not in (None, Overlong.keep) and not (a.overlong_max_tokens and a.overlong_buffer):
            raise ValueError(f"overlong {a.overlong} needs algorithm.overlong_max_tokens and overlong_buffer")
        return cls(
            learning_rate=a.learning_rate,
            clip_eps=a.clip_eps,
            clip_high=a.clip_eps_high,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            max_grad_norm=a.max_grad_norm,
            skip_zero_variance=a.skip_zero_variance,
            advantage=a.advantage or Advantage.group_norm,
            aggregation=a.aggregation or Aggregation.token_mean,
            loss_constant=float(a.loss_constant or 1),
            overlong=a.overlong or Overlong.keep,
            overlong_max_tokens=a.overlong_max_tokens or 0,
            overlong_buffer=a.overlong_buffer or 0,
            weight_decay=s.weight_decay,
            adv_eps=s.adv_eps,
            micro_batch_tokens=a.max_tokens_per_microbatch or s.micro_batch_tokens,
            bf16=s.bf16 if a.precision is None else a.precision is Precision.bf16,
            gradient_checkpointing=a.gradient_checkpointing,
            share_prompts=s.share_prompts,
            memory_limit_gb=s.memory_limit_gb,
            lora=a.lora,
            mismatch_tolerance=a.mismatch.tolerance,
            mismatch_max_share=a.mismatch.max_share,
            on_mismatch=a.mismatch.on_mismatch,
            correction=a.correction.kind,
            correction_level=a.correction.level,
            correction_cap=a.correction.cap,
        )


@dataclass
class StepStats:
    """What one call of :meth:`Learner.step` did. ``updated`` is False when nothing was
    left to learn from (every group skipped), and then the weights did not change."""

    step: int
    version: int
    updated: bool
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0  # mean policy entropy (nats) over the model tokens, measured on every step
    clip_fraction: float = 0.0
    ratio_mean: float = 1.0
    abs_log_ratio: float = 0.0  # mean |log pi_theta - log pi_behaviour| over model tokens
    reward_mean: float = 0.0
    reward_std: float = 0.0
    grad_norm: float = 0.0
    learning_rate: float = 0.0  # the optimizer's at this step
    groups: int = 0
    skipped_groups: int = 0
    samples: int = 0
    filtered_samples: int = 0  # overlong responses that carried no loss
    tokens: int = 0  # every real (non-pad) token forwarded and backpropagated
    model_tokens: int = 0  # the tokens the loss is averaged over
    micro_batches: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    # per sample: versions between this step's and its oldest token's (what max_staleness bounds)
    staleness: list[int] = field(default_factory=list)
    staleness_mean: float = 0.0
    staleness_max: int = 0
    # per model token: versions between this step's and the one that sampled the token
    token_staleness_mean: float = 0.0
    token_staleness_max: int = 0
    # samples whose tokens came from two or more versions (partial rollouts), and their share
    multi_version_samples: int = 0
    multi_version_share: float = 0.0
    # the logprob canary: tokens sampled by this version before this step changed the weights,
    # their |recomputed - behaviour| (mean, max), the share past the tolerance, and whether the
    # batch failed (more than max_share past it); refused: the step was not taken, and why
    canary: bool = False  # the first step on this version's weights: the canary ran
    mismatch_tokens: int = 0
    mismatch_mean: float = 0.0
    mismatch_max: float = 0.0
    mismatch_share: float = 0.0
    mismatch_failed: bool = False
    refused: str = ""
    # the mismatch correction (algorithm.correction): the mean of each token's weight c_t
    # (1 without a correction) and the share of tokens whose rho passed the cap
    correction_weight_mean: float = 1.0
    correction_capped_fraction: float = 0.0
    # pairs (dpo, reward_model): the share of pairs the model ranked right before the step
    # (dpo: the implicit reward beta * (log-ratio chosen - log-ratio rejected) > 0)
    pair_accuracy: float = 0.0

    def as_dict(self, *, with_staleness: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_staleness:
            d.pop("staleness")
        return d


@dataclass
class Accumulated:
    """Sums over the model tokens of a step's micro-batches."""

    loss: float = 0.0  # the weighted loss (sum over micro-batches)
    pg: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    ratio: float = 0.0
    abs_log_ratio: float = 0.0
    correction: float = 0.0  # sum of c_t
    corrected: float = 0.0  # tokens past the cap
    tokens: int = 0
    micro_batches: int = 0
    mismatch: Mismatch = field(default_factory=Mismatch)
    canary: bool = False  # the micro-batches ran on the weights of the learner's version


REFUSED_MISMATCH = "logprob_mismatch"


class Learner:
    """Holds the policy, an optional frozen reference policy (for the KL term) and AdamW.

    ``step`` counts optimizer steps; ``version`` is the policy version the weights
    correspond to (bumped by whoever publishes a checkpoint, see :meth:`save_checkpoint`).

    ``model`` may be a :class:`temper.training.lora.SharedBase` (with ``config.lora``):
    the learner then adds its own adapter to that base model, which other learners share,
    and holds only the adapter's weights and their AdamW state; every method that uses
    the model activates this learner's adapter first.
    """

    def __init__(
        self,
        model: torch.nn.Module | SharedBase,
        config: LearnerConfig | None = None,
        *,
        device: torch.device | str | None = None,
        reference: torch.nn.Module | None = None,
        pad_id: int | None = None,
        step: int = 0,
        version: int = 0,
    ) -> None:
        self.config = config or LearnerConfig()
        self.device = torch.device(device) if device is not None else pick_device()
        self.lora = self.config.lora is not None
        self.shared: SharedBase | None = None
        self.adapter = "default"
        if isinstance(model, SharedBase):
            if self.config.lora is None:
                raise ValueError("a shared base model holds LoRA adapters: this job has no algorithm.lora")
            self.shared, self.adapter = model, model.add(self.config.lora)
            try:
                with self.adapter_active():
                    self._setup(model.model, None, pad_id)
            except Exception:
                model.remove(self.adapter)
                raise
        else:
            if self.config.lora is not None:
                # the reference policy is this model with the adapter off: never a second copy
                model, reference = apply_lora(model, self.config.lora), None
            self._setup(model, reference, pad_id)
        self.step_count = step
        self.version = version
        # set by temper.training.distributed.shard: the whole model is called (its root
        # gathers the output layer), and the loss is multiplied by the world size because
        # FSDP averages the ranks' gradients where the step needs their sum
        self.full_forward = False
        self.loss_scale = 1.0
        # this process's place among the ranks of a sharded learner (shard sets them)
        self.rank, self.world = 0, 1

    def _setup(self, model: torch.nn.Module, reference: torch.nn.Module | None, pad_id: int | None) -> None:
        """Plan the memory, place the model, and build AdamW over its trainable weights."""
        wants_reference = self.config.kl_coef > 0 or self.config.dpo_beta is not None
        self.memory_plan = self.plan_memory(
            model, reference_copy=wants_reference and reference is None and not self.lora
        )
        self.model = model.to(self.device).float()
        self.model.train()
        if self.config.gradient_checkpointing:
            # transformers 5 renamed it (the old name warns); older releases have only the old one
            new: Callable[..., Any] | None = getattr(self.model, "activation_checkpointing_enable", None)
            old: Callable[..., Any] | None = getattr(self.model, "gradient_checkpointing_enable", None)
            if new is not None:
                new({"use_reentrant": False})
            elif old is not None:
                old(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                raise ValueError("gradient_checkpointing: this model does not support it")
        if wants_reference and reference is None and not self.lora:
            reference = copy.deepcopy(model)  # the policy as it is now: normally the initial weights
        self.reference = reference.to(self.device).eval() if reference is not None else None
        if self.reference is not None:
            for p in self.reference.parameters():
                p.requires_grad_(False)
        cfg = getattr(model, "config", None)
        self.pad_id = pad_id if pad_id is not None else int(getattr(cfg, "pad_token_id", None) or 0)
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.learning_rate,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )

    def adapter_active(self) -> contextlib.AbstractContextManager[Any]:
        """On a shared base model: this learner's adapter active, the base held by this
        thread, for the duration. Otherwise nothing to do."""
        if self.shared is None:
            return contextlib.nullcontext()
        return self.shared.active(self.adapter)

    def plan_memory(self, model: torch.nn.Module, *, reference_copy: bool) -> MemoryEstimate:
        """Estimate the job's memory (temper.training.memory), log it with the alternatives,
        and refuse (:class:`MemoryPlanError`) a plan above the limit, before any weight
        moves to the device."""
        import torch.distributed as dist

        cfg = self.config
        shape = model_shape(model)
        plan = estimate(
            shape,
            micro_batch_tokens=cfg.micro_batch_tokens,
            gradient_checkpointing=cfg.gradient_checkpointing,
            bf16=self.device.type == "cuda" and cfg.bf16,
            reference=reference_copy,
            # under torchrun the learner is about to be sharded over every rank
            ranks=dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        )
        lora = lora_trainable(model, 16)
        log_event(log, "memory plan", plan=plan.describe(), device=str(self.device),
                  alternatives={what: size(alt.total) for what, alt in alternatives(shape, plan, lora=lora)})  # fmt: skip
        limit = None
        if cfg.memory_limit_gb is not None:
            limit = int(cfg.memory_limit_gb * GiB)
        elif self.device.type == "cuda":
            limit = torch.cuda.get_device_properties(self.device).total_memory
        if limit is not None:
            check_fits(shape, plan, limit, lora=lora, device=str(self.device))
        return plan

    @property
    def autocast_enabled(self) -> bool:
        return self.device.type == "cuda" and self.config.bf16

    def _autocast(self) -> torch.autocast:
        return torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=self.autocast_enabled
        )

    # --- training ----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version the learner is at. Setting it (a publish, a load) says the
        weights are that version's, which the canary relies on until the next optimizer step."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value
        self.weights_at_version = True

    def step(self, groups: Sequence[Sequence[Trajectory]]) -> StepStats:
        """One optimizer step on ``groups`` (each: the trajectories of one task)."""
        samples, skipped = samples_from_groups(
            groups, skip_zero_variance=self.config.skip_zero_variance, objective=self.config.objective()
        )
        return self.step_samples(samples, groups=len(groups), skipped_groups=skipped)

    def step_conversations(self, encoded: Sequence[tuple[list[int], list[bool]]]) -> StepStats:
        """One sft step on encoded conversations (ids, mask of the trained tokens:
        :func:`temper.training.sft.encode_chat`), cut into micro-batches as an RL step's."""
        if not self.config.sft:
            raise ValueError("step_conversations is the sft step; this learner's algorithm is RL")
        samples = [Sample(ids, mask, [0.0] * len(ids), 0.0, 0.0, self.version) for ids, mask in encoded]
        return self.step_samples(samples, groups=len(samples))

    @on_adapter
    def step_pairs(
        self, pairs: Sequence[tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]]
    ) -> StepStats:
        """One DPO step on (chosen, rejected) conversations, each (ids, mask of the trained
        tokens): :func:`temper.training.dpo.dpo_loss` over the sequence logprobs of the
        policy and of the reference (the frozen copy, or this model with its adapter off
        under LoRA, as the KL term's). A pair's two rows share a micro-batch, so the loss,
        which couples them, is exact however the batch is cut."""
        from temper.training.dpo import dpo_loss, pair_micro_batches

        beta = self.config.dpo_beta
        if beta is None:
            raise ValueError("step_pairs is the DPO step; this learner has no dpo_beta")
        started = time.perf_counter()
        stats = StepStats(step=self.step_count, version=self.version, updated=False, samples=2 * len(pairs))
        if not pairs:
            return stats
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        tokens, batches, right, margins = 0, 0, 0, 0.0
        for mb in pair_micro_batches(pairs, self.config.micro_batch_tokens):
            rows = [Sample(ids, mask, [0.0] * len(ids), 0.0, 0.0) for pair in mb for ids, mask in pair]
            b = collate([self._truncate(r) for r in rows], self.pad_id, self.device)
            with self._autocast():
                logp = completion_logprobs(self.model, b.input_ids, b.attention_mask, b.completion_mask)
                with torch.no_grad():
                    if self.reference is not None:
                        ref = completion_logprobs(
                            self.reference, b.input_ids, b.attention_mask, b.completion_mask
                        )
                    else:
                        with reference_off(self.model):
                            ref = completion_logprobs(
                                self.model, b.input_ids, b.attention_mask, b.completion_mask
                            )
            seq, ref_seq = logp.float().sum(-1), ref.float().sum(-1)
            loss = dpo_loss(seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], beta).sum() / len(pairs)
            loss.backward()
            stats.loss += float(loss.detach())
            implicit = (seq[0::2] - ref_seq[0::2]) - (seq[1::2] - ref_seq[1::2])
            right += int((implicit.detach() > 0).sum())
            margins += float(beta * implicit.detach().sum())
            tokens += b.tokens
            batches += 1
        self._finish_pair_step(
            stats, started, len(pairs), right=right, margins=margins, tokens=tokens, batches=batches
        )
        return stats

    def _finish_pair_step(
        self,
        stats: StepStats,
        started: float,
        pairs: int,
        *,
        right: int,
        margins: float,
        tokens: int,
        batches: int,
    ) -> None:
        """The end of a DPO or reward-model step: clip, step (when the gradient is finite),
        and the step's figures over its ``pairs``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.weights_at_version = False
            self.step_count += 1
            stats.updated = True
        self.optimizer.zero_grad(set_to_none=True)
        stats.step, stats.grad_norm, stats.tokens, stats.micro_batches = (
            self.step_count,
            grad_norm,
            tokens,
            batches,
        )
        stats.pg_loss = stats.loss
        stats.reward_mean = margins / pairs
        stats.pair_accuracy = right / pairs
        stats.learning_rate = float(self.optimizer.param_groups[0]["lr"])
        stats.seconds = time.perf_counter() - started

    def step_preferences(self, pairs: Sequence[tuple[list[int], list[int]]]) -> StepStats:
        """One reward-model step on (chosen, rejected) id sequences
        (:func:`temper.training.reward_model.encode`): the Bradley-Terry loss
        (:func:`~temper.training.reward_model.bradley_terry_loss`) averaged over the pairs.
        A pair's two rows share a micro-batch. ``reward_mean`` is the mean margin
        ``r_chosen - r_rejected`` and ``pair_accuracy`` the share of pairs the model ranked
        right, both before the step."""
        from temper.training.dpo import pair_micro_batches
        from temper.training.reward_model import bradley_terry_loss, sequence_scores

        if not self.config.reward_model:
            raise ValueError("step_preferences is the reward-model step; this learner trains a policy")
        started = time.perf_counter()
        stats = StepStats(step=self.step_count, version=self.version, updated=False, samples=2 * len(pairs))
        if not pairs:
            return stats
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        tokens, batches, right, margins = 0, 0, 0, 0.0
        limit = self.max_len
        encoded: list[tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]] = [
            ((c[-limit:] if limit else c, []), (r[-limit:] if limit else r, [])) for c, r in pairs
        ]
        for mb in pair_micro_batches(encoded, self.config.micro_batch_tokens):
            rows = [ids for pair in mb for ids, _ in pair]
            with self._autocast():
                scores = sequence_scores(self.model, rows, self.pad_id, self.device)
            margin = scores[0::2] - scores[1::2]
            loss = bradley_terry_loss(scores[0::2], scores[1::2]).sum() / len(pairs)
            loss.backward()
            stats.loss += float(loss.detach())
            right += int((margin > 0).sum())
            margins += float(margin.detach().sum())
            tokens += sum(len(r) for r in rows)
            batches += 1
        self._finish_pair_step(
            stats, started, len(pairs), right=right, margins=margins, tokens=tokens, batches=batches
        )
        stats.tokens_per_s = tokens / stats.seconds if stats.seconds > 0 else 0.0
        return stats

    @on_adapter
    def step_samples(
        self, samples: Sequence[Sample], *, groups: int = 0, skipped_groups: int = 0
    ) -> StepStats:
        """One optimizer step on samples whose advantages are already set."""
        started = time.perf_counter()
        samples = [self._truncate(s) for s in samples]
        stats = StepStats(
            step=self.step_count,
            version=self.version,
            updated=False,
            groups=groups,
            skipped_groups=skipped_groups,
            samples=len(samples),
            filtered_samples=sum(s.filtered for s in samples),
        )
        if samples:
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
            stats.reward_mean = float(rewards.mean())
            stats.reward_std = float(rewards.std(unbiased=False))
            stats.staleness = [self.version - s.behaviour_version for s in samples]
            stats.staleness_mean = sum(stats.staleness) / len(stats.staleness)
            stats.staleness_max = max(stats.staleness)
            per_sample = [s.model_versions() for s in samples]
            lags = [self.version - v for versions in per_sample for v in versions]
            if lags:
                stats.token_staleness_mean = sum(lags) / len(lags)
                stats.token_staleness_max = max(lags)
            stats.multi_version_samples = sum(len(set(versions)) > 1 for versions in per_sample)
            stats.multi_version_share = stats.multi_version_samples / len(samples)
        # token 0 of a sample has no context and is never scored (see collate)
        normalizer = sum(s.scored_tokens for s in samples)
        if normalizer == 0:
            stats.seconds = time.perf_counter() - started
            return stats

        self.optimizer.zero_grad(set_to_none=True)
        if self.world > 1:
            # each rank trains on its share; the loss weights are the whole batch's
            from temper.training.distributed import full_norm, share, summed

            acc = self.backward(share(samples, self.rank, self.world), normalizer, batch=samples)
            mm = acc.mismatch
            (
                acc.loss,
                acc.pg,
                acc.kl,
                acc.entropy,
                acc.clipped,
                acc.ratio,
                acc.abs_log_ratio,
                acc.correction,
                acc.corrected,
                t,
                checked,
                mm.sum_abs,
                over,
            ) = summed(
                [
                    acc.loss,
                    acc.pg,
                    acc.kl,
                    acc.entropy,
                    acc.clipped,
                    acc.ratio,
                    acc.abs_log_ratio,
                    acc.correction,
                    acc.corrected,
                    acc.tokens,
                    mm.checked,
                    mm.sum_abs,
                    mm.over,
                ],
                self.device,
            )
            acc.tokens, mm.checked, mm.over = int(t), int(checked), int(over)  # max_abs: this rank's
        else:
            acc = self.backward(samples, normalizer)
        mm = acc.mismatch
        stats.canary = acc.canary
        stats.mismatch_tokens, stats.mismatch_mean, stats.mismatch_max = mm.checked, mm.mean, mm.max_abs
        stats.mismatch_share = mm.share_over
        stats.mismatch_failed = mm.failed(self.config.mismatch_max_share)
        if stats.mismatch_failed and self.config.on_mismatch is not OnMismatch.flag:
            # the engine's logprobs are not this version's: no step learns from them
            self.optimizer.zero_grad(set_to_none=True)
            stats.refused = REFUSED_MISMATCH
            stats.seconds = time.perf_counter() - started
            return stats
        pg, kl, clipped, ratio, alr = acc.pg, acc.kl, acc.clipped, acc.ratio, acc.abs_log_ratio
        tokens, batches = acc.tokens, acc.micro_batches
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        grad_norm = float(norm) if self.world == 1 else full_norm(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.weights_at_version = False  # until the next version is published
            self.step_count += 1
            stats.updated = True
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        stats.step = self.step_count
        stats.pg_loss = pg / normalizer
        stats.kl = kl / normalizer
        stats.entropy = acc.entropy / normalizer
        stats.loss = acc.loss
        stats.clip_fraction = clipped / normalizer
        stats.ratio_mean = ratio / normalizer
        stats.abs_log_ratio = alr / normalizer
        stats.correction_weight_mean = acc.correction / normalizer
        stats.correction_capped_fraction = acc.corrected / normalizer
        stats.grad_norm = grad_norm
        stats.learning_rate = float(self.optimizer.param_groups[0]["lr"])
        stats.tokens = tokens
        stats.model_tokens = normalizer
        stats.micro_batches = batches
        stats.seconds = seconds
        stats.tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        return stats

    @on_adapter
    def backward(
        self,
        samples: Sequence[Sample],
        normalizer: int | None = None,
        *,
        batch: Sequence[Sample] | None = None,
    ) -> Accumulated:
        """Forward and backward every micro-batch of ``samples``, adding the gradient of
        the step's loss to ``.grad`` (the optimizer is not touched). The loss weights
        (the aggregation) are computed over ``batch``, the whole optimizer batch, of
        which ``samples`` may be one rank's share (default: ``samples`` itself), so that
        the ranks' gradients sum to the whole batch's. ``normalizer`` is kept for callers
        of the token-mean form and must equal the scored tokens."""
        obj = self.config.objective()
        whole = samples if batch is None else batch
        for s, w in zip(whole, sample_weights([s.scored_tokens for s in whole], obj), strict=True):
            s.weight = w * self.loss_scale
        if normalizer is None:
            normalizer = sum(s.scored_tokens for s in samples)
        self.model.train()
        acc = Accumulated()
        # the weights that sampled this version's tokens (sft data was sampled by none)
        canary = acc.canary = self.weights_at_version and not self.config.sft
        share = self._shares_prompts()
        if share:
            batches = prompt_micro_batches(samples, self.config.micro_batch_tokens)
        else:
            batches = micro_batches(samples, self.config.micro_batch_tokens)
        if self.loss_scale != 1.0:
            batches = self._same_count_on_every_rank(batches)
        for mb in batches:
            cores.fit()  # the engine may have started or stopped since the last micro-batch
            b = collate(mb, self.pad_id, self.device)
            # measured on every step; differentiated only for the bonus
            entropy: list[torch.Tensor] = []
            bonus = bool(obj.entropy_coef)
            with self._autocast():
                if share:
                    logprobs = shared_prompt_logprobs(self.model, mb, b, self.pad_id, entropy, bonus)
                elif self.full_forward:  # a sharded model is called as a whole (its root gathers the head)
                    logprobs = token_logprobs(
                        self.model, b.input_ids, b.attention_mask, b.completion_mask,
                        entropy=entropy, entropy_grad=bonus,
                    )  # fmt: skip
                else:
                    logprobs = completion_logprobs(
                        self.model, b.input_ids, b.attention_mask, b.completion_mask, entropy, bonus
                    )
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = completion_logprobs(
                            self.reference, b.input_ids, b.attention_mask, b.completion_mask
                        )
                elif self.lora and self.config.kl_coef > 0:
                    with torch.no_grad(), reference_off(self.model):
                        ref = completion_logprobs(
                            self.model, b.input_ids, b.attention_mask, b.completion_mask
                        )
            if canary:
                # every token this version sampled, whatever the versions of its neighbours
                acc.mismatch.add(
                    compare(
                        logprobs,
                        b.behaviour_logprobs,
                        b.completion_mask,
                        b.token_versions == self.version,
                        tolerance=self.config.mismatch_tolerance,
                    )
                )
            if self.config.sft:
                self._sft_backward(acc, logprobs.float(), b, entropy[0] if entropy else None)
                continue
            parts = grpo_token_loss(
                logprobs.float(),
                b.behaviour_logprobs,
                b.advantages,
                b.completion_mask,
                clip_eps=obj.clip_low,
                clip_high=obj.clip_high,
                weights=b.weights,
                ref_logprobs=None if ref is None else ref.float(),
                kl_coef=obj.kl_coef,
                kl=obj.kl,
                entropy=entropy[0] if entropy else None,
                entropy_coef=obj.entropy_coef,
                # one optimizer step a batch: the weights before it are these, so the
                # proximal policy of the correction is this forward, detached
                proximal_logprobs=logprobs.detach().float(),
                correction=obj.correction,
                correction_level=obj.correction_level,
                correction_cap=obj.correction_cap,
            )
            parts.loss.backward()
            acc.loss += float(parts.loss.detach()) / self.loss_scale
            acc.entropy += parts.entropy_sum
            acc.pg += parts.pg_sum
            acc.kl += parts.kl_sum
            acc.clipped += parts.clipped
            acc.ratio += parts.ratio_sum
            acc.abs_log_ratio += parts.abs_log_ratio_sum
            acc.correction += parts.correction_sum
            acc.corrected += parts.corrected
            acc.tokens += b.tokens
        acc.micro_batches = len(batches)
        return acc

    def _shares_prompts(self) -> bool:
        """Whether an RL step runs each group's prompt once (``temper.training.prompts``):
        on one device, not under gradient checkpointing (which drops the cache it needs),
        for a model whose decoder takes a cache."""
        return (
            self.config.share_prompts
            and not self.config.sft
            and self.world == 1
            and not self.full_forward
            and not self.config.gradient_checkpointing
            and can_share(self.model)
        )

    def _sft_backward(
        self, acc: Accumulated, logprobs: torch.Tensor, b: Any, entropy: torch.Tensor | None
    ) -> None:
        """One micro-batch of the sft loss: ``-sum_i w_i sum_t m_it log p(y_it)``, with the
        token-mean weights over the whole step (``w_i = 1/N``), so micro-batches add up to
        the step's mean negative log-likelihood however the batch was cut."""
        mask = b.completion_mask.float()
        nll = -(logprobs * mask).sum(-1)
        loss = (nll * b.weights).sum()
        loss.backward()
        acc.loss += float(loss.detach()) / self.loss_scale
        acc.pg += float(nll.detach().sum())  # the unweighted sum: pg_loss is the mean nll
        if entropy is not None:
            acc.entropy += float((entropy.detach() * mask).sum())
        acc.ratio += float(mask.sum())  # no ratio: 1 per token, as an on-policy step reads
        acc.correction += float(mask.sum())
        acc.tokens += b.tokens

    def _same_count_on_every_rank(self, batches: list[list[Sample]]) -> list[list[Sample]]:
        """Sharded training: FSDP's collectives need every rank to run as many forward and
        backward passes, so a rank with fewer micro-batches adds passes that weigh nothing."""
        import torch.distributed as dist

        most = torch.tensor([len(batches)], device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        idle = Sample([self.pad_id, self.pad_id], [False, False], [0.0, 0.0], 0.0, 0.0)
        return batches + [[idle]] * (int(most) - len(batches))

    def _truncate(self, s: Sample) -> Sample:
        if self.max_len is None or len(s.ids) <= self.max_len:
            return s
        k = self.max_len
        return Sample(
            s.ids[:k],
            s.mask[:k],
            s.behaviour_logprobs[:k],
            s.advantage,
            s.reward,
            s.behaviour_version,
            s.episode_id,
            s.group_id,
            filtered=s.filtered,
            versions=s.versions[:k],
        )

    @on_adapter
    @torch.no_grad()
    def logprobs(self, trajectory: Trajectory) -> list[float]:
        """The current policy's logprob of every token of ``trajectory`` (0 where masked)."""
        ids, mask, _ = trajectory.flat()
        t = torch.tensor([ids], device=self.device)
        m = torch.tensor([mask], device=self.device)
        self.model.eval()
        out = token_logprobs(self.model, t, torch.ones_like(t), m)[0].float().cpu().tolist()
        self.model.train()
        return out

    # --- checkpoints --------------------------------------------------------------------

    @on_adapter
    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA learner's adapter weights, copied to the CPU (PEFT's key names)."""
        return adapter_state(self.model, self.adapter)

    @on_adapter
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        load_adapter_state(self.model, tensors, self.adapter)
        self.model.to(self.device)

    def weights_bytes(self, metadata: dict[str, Any] | None = None) -> bytes:
        """The weights as one safetensors file (tied embeddings stored once); with LoRA,
        the adapter's weights alone (PEFT's key names)."""
        if self.lora:
            meta = {k: str(v) for k, v in (metadata or {}).items()}
            return st_save(self.adapter_weights(), metadata=meta or None)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "model.safetensors"
            save_weights(self.model, path, metadata=metadata)
            return path.read_bytes()

    def optimizer_bytes(self, *, version: int | None = None) -> bytes:
        """AdamW state as safetensors: ``state.<param>.<name>`` tensors; param groups,
        step and version in the metadata."""
        sd = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for idx, state in sd["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{idx}.{name}"] = value.detach().to("cpu").contiguous()
                else:
                    scalars[f"{idx}.{name}"] = value
        meta = {
            "format": OPTIMIZER_FORMAT,
            "param_groups": json.dumps(sd["param_groups"]),
            "scalars": json.dumps(scalars),
            "step": str(self.step_count),
            "version": str(self.version if version is None else version),
        }
        return st_save(tensors, metadata=meta)

    def load_weights_bytes(self, data: bytes) -> None:
        if self.lora:
            self.load_adapter(st_load(data))
            return
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "model.safetensors"
            path.write_bytes(data)
            load_weights(self.model, path)
        self.model.to(self.device)

    def load_optimizer_bytes(self, data: bytes) -> dict[str, str]:
        """Restore AdamW state; returns the file's metadata (step, version)."""
        from safetensors import safe_open

        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "optimizer.safetensors"
            path.write_bytes(data)
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
        if meta.get("format") != OPTIMIZER_FORMAT:
            raise ValueError(f"not a Temper optimizer checkpoint (format={meta.get('format')!r})")
        tensors = st_load(data)
        state: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
        for name, value in json.loads(meta["scalars"]).items():
            idx, key = name.split(".", 1)
            state.setdefault(int(idx), {})[key] = value
        groups = json.loads(meta["param_groups"])
        for g in groups:
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        return meta

    async def save_checkpoint(self, store: ObjectStore, key: str, *, version: int | None = None) -> list[str]:
        """Write weights to ``key`` and optimizer state beside it; returns both keys.
        ``version`` (default: the current one) is recorded in both files."""
        import asyncio

        v = self.version if version is None else version
        meta = {"step": self.step_count, "version": v, "format": "temper-policy-v1"}
        weights, optim = await asyncio.to_thread(
            lambda: (self.weights_bytes(meta), self.optimizer_bytes(version=v))
        )
        okey = optimizer_key(key)
        # optimizer first: the weights file is what readers look for, so it lands last
        await store.put(okey, optim)
        await store.put(key, weights)
        return [key, okey]

    async def load_checkpoint(self, store: ObjectStore, key: str) -> None:
        """Restore weights, optimizer state, step and version from a checkpoint written by
        :meth:`save_checkpoint`."""
        import asyncio

        weights = await store.get(key)
        optim = await store.get(optimizer_key(key))

        def restore() -> dict[str, str]:
            self.load_weights_bytes(weights)
            return self.load_optimizer_bytes(optim)

        meta = await asyncio.to_thread(restore)
        self.step_count = int(meta["step"])
        self.version = int(meta["version"])

    # --- published versions (temper.registry) --------------------------------------------

    def export_version(self, directory: str | Path, *, tokenizer: Any = None) -> str:
        """Write what a server loads into ``directory``; returns the kind: ``"lora"`` (a
        PEFT adapter directory) or ``"full"`` (a Hugging Face model directory with
        ``tokenizer``, a :class:`temper.policy.ChatTokenizer`)."""
        from temper.policy import save_checkpoint

        if self.lora:
            with self.adapter_active():
                save_adapter(self.model, directory, self.adapter)
            return "lora"
        save_checkpoint(self.model, directory, tokenizer=tokenizer)
        return "full"

    async def publish_version(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        job_id: str,
        version: int,
        base_model: str,
        tokenizer: Any = None,
    ) -> str:
        """Publish the current weights as ``version`` under ``prefix`` (with the optimizer
        state as a trainer file); returns the manifest key."""
        import asyncio

        from temper import registry

        if self.world > 1:
            return await self._publish_sharded(
                store, prefix, job_id=job_id, version=version, base_model=base_model, tokenizer=tokenizer
            )
        with tempfile.TemporaryDirectory() as d:
            kind = await asyncio.to_thread(self.export_version, d, tokenizer=tokenizer)
            optim = await asyncio.to_thread(self.optimizer_bytes, version=version)
            return await registry.publish_version(
                store,
                prefix,
                d,
                job_id=job_id,
                version=version,
                kind=kind,  # type: ignore[arg-type]
                base_model=base_model,
                step=self.step_count,
                extra={f"{registry.TRAINER_DIR}/optimizer.safetensors": optim},
            )

    async def _publish_sharded(
        self, store: ObjectStore, prefix: str, *, job_id: str, version: int, base_model: str, tokenizer: Any
    ) -> str:
        """:meth:`publish_version` of a sharded learner; every rank calls it. The weights are
        gathered on rank 0 and published as a full model directory (what servers load);
        the model and AdamW state go to ``trainer/dcp/`` with DCP, each rank uploading
        its own shard file, and rank 0 writes the manifest once every rank has uploaded."""
        import asyncio

        import torch.distributed as dist

        from temper import registry
        from temper.policy import save_checkpoint
        from temper.training import distributed as fsdp

        base = f"{registry.TRAINER_DIR}/{fsdp.DCP_DIR}"
        with tempfile.TemporaryDirectory() as d:
            full = await asyncio.to_thread(fsdp.full_weights, self)
            written = await asyncio.to_thread(fsdp.save_state, self, Path(d) / "dcp")
            mine: dict[str, registry.FileEntry] = {}
            error = None
            try:
                for path in written:
                    data = path.read_bytes()
                    await store.put(f"{prefix.rstrip('/')}/{base}/{path.name}", data)
                    mine[f"{base}/{path.name}"] = registry.FileEntry(
                        sha256=registry.sha256(data), size=len(data)
                    )
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the publish
                error = f"rank {self.rank}: {exc!r}"[:300]
            # every rank reaches the gather, so a failed upload cannot hang the others
            gathered: list[Any] = [None] * self.world
            await asyncio.to_thread(dist.all_gather_object, gathered, (mine, error))
            errors = [e for _, e in gathered if e]
            if errors:
                raise RuntimeError("sharded checkpoint upload failed: " + "; ".join(errors))
            if self.rank != 0:
                return registry.manifest_key(prefix)
            uploaded = {name: entry for files, _ in gathered for name, entry in files.items()}
            hf = Path(d) / "model"
            await asyncio.to_thread(save_checkpoint, self.model, hf, tokenizer=tokenizer, state_dict=full)
            return await registry.publish_version(
                store,
                prefix,
                hf,
                job_id=job_id,
                version=version,
                kind="full",
                base_model=base_model,
                step=self.step_count,
                uploaded=uploaded,
            )

    async def load_version(self, store: ObjectStore, manifest_key: str) -> None:
        """Restore weights (or adapter), optimizer, step and version from a published
        version; a corrupt one raises :class:`temper.registry.CorruptVersion`. A version
        with sharded state (``trainer/dcp/``, written by a sharded learner) is restored
        from it, on any number of ranks."""
        import asyncio

        from temper import registry
        from temper.training.distributed import DCP_DIR

        manifest = await registry.read_manifest(store, manifest_key)
        sharded = sorted(n for n in manifest.files if n.startswith(f"{registry.TRAINER_DIR}/{DCP_DIR}/"))
        if sharded and not self.lora:
            _, files = await registry.fetch_files(store, manifest_key, names=sharded)
            with tempfile.TemporaryDirectory() as d:
                for name, data in files.items():
                    (Path(d) / Path(name).name).write_bytes(data)
                from temper.training.distributed import load_state

                await asyncio.to_thread(load_state, self, d)
            self.step_count, self.version = manifest.step, manifest.version
            return
        if self.world > 1:
            raise ValueError(f"{manifest_key} has no sharded state: load it before sharding the learner")
        manifest, files = await registry.fetch_files(store, manifest_key, trainer=True)
        if (manifest.kind == "lora") != self.lora:
            raise registry.CorruptVersion(
                f"{manifest_key} is a {manifest.kind} version but this learner trains "
                f"{'a LoRA adapter' if self.lora else 'full weights'}"
            )

        def restore() -> None:
            if self.lora:
                self.load_adapter(st_load(files["adapter_model.safetensors"]))
            else:
                with tempfile.TemporaryDirectory() as d:
                    for name, data in files.items():
                        (Path(d) / name).parent.mkdir(parents=True, exist_ok=True)
                        (Path(d) / name).write_bytes(data)
                    load_weights(self.model, d)
            self.model.to(self.device)
            self.load_optimizer_bytes(files[f"{registry.TRAINER_DIR}/optimizer.safetensors"])

        await asyncio.to_thread(restore)
        self.step_count, self.version = manifest.step, manifest.version
