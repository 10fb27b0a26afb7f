"""GPU check: what a GPU user needs to know about Temper's learner and engine, measured
with Temper's own code. Writes ``bench/results/gpu.json`` (a flat JSON object).

Parts, in order of value (``make gpu-check`` runs them in this order):

- ``learner``: a Qwen2.5-1.5B-shaped body (28 layers, hidden 1536, 12 heads, 2 KV heads,
  MLP 8960, vocabulary 151,936, tied embeddings; seeded random weights), fp32 master
  weights with bf16 autocast, gradient checkpointing, token-budget micro-batches, GRPO
  steps of :class:`temper.training.Learner` on synthetic trajectories of about 1k
  prompt + 1k completion tokens; full weights, then a LoRA adapter (rank 16 on every
  linear layer of the decoder, KL to the base). Figures: tokens/s, MFU (below), and
  the peak allocated memory against ``temper.training.memory.estimate`` (within 15 %).
- ``engine``: the CPU engine's generation code (``services.inference_gateway.cpu_server
  .runner.ModelRunner``) on CUDA at the same size in bf16, one batch mixing the base and two
  LoRA adapters: tokens/s, and each row's logprobs against the model's own forward
  with that row's adapter (within bf16 tolerance; and far from the other adapters').
- ``fsdp``: with two or more GPUs, the learner under ``torchrun`` with FSDP2 on NCCL
  against one process on the same batches: equal losses within tolerance, tokens/s per
  GPU. With one GPU it is skipped with a line saying why.

MFU (model FLOPs utilisation) = model FLOPs of the measured steps / (their seconds x the
device's dense bf16 peak, :data:`PEAK_BF16_TFLOPS`). Model FLOPs are counted from the
architecture, per sample of ``T`` tokens of which ``S`` are scored (:func:`step_flops`):

    forward  F = 2 N T + 2 h V S + 2 L d T (T + 1)
    full weights: 3 F                        ("6N plus attention")
    LoRA:         2 F + A + 6 N_lora T       (frozen weights: input gradients only)
    + F again when the KL reference's forward runs

with ``N`` the weights of the decoder layers' matrix multiplications (q, k, v, o, gate,
up, down), ``h V`` the output layer's (Temper computes logits only at scored positions),
``L d T (T + 1)`` the causal attention (``d`` = heads x head size: the query-key scores
and the weighted sum of values over ``T (T + 1) / 2`` pairs, 2 FLOPs a multiply-add),
``A`` the attention's share of ``F`` (its backward is twice its forward even when every
weight is frozen), ``N_lora`` the adapters' weights. Not counted: the recomputation of
gradient checkpointing (model FLOPs, not hardware FLOPs), padding, norms, softmax and the
optimizer.

Run it with the GPU machine's own Python and packages (no project venv, nothing fetched
there) and the carried wheels below; ``--plan`` needs the standard library alone:

    PYTHONPATH=libs:. python3 bench/gpu_check.py --plan          # the parts and their minutes
    make gpu-check                                               # the plan, then every part
    make gpu-check ARGS="--part engine"                          # one part on its own
    PYTHONPATH=libs:. .venv/bin/python bench/gpu_check.py --size tiny --device cpu   # every part's code on a CPU

Each part merges its figures into the JSON file as it finishes (a run cut short keeps
what it measured), prints one line, and a failed check makes the exit status 1.

A GPU machine's image has torch, transformers, peft, safetensors and tokenizers but not
pydantic or minio, which Temper's training library imports: ``bash scripts/gpu_wheels.sh``
(here) puts their wheels, at requirements.lock's versions, in ``.gpu-wheels/``; carry
that folder, and ``make gpu-check`` installs them into a folder of their own there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu.json"
PARTS = ("learner", "engine", "fsdp")  # in order of value
DEVICE_BUDGET_MIN = 15.0  # a lent GPU machine: device time for the whole session
MACHINE_START_MIN = 3.0  # of which starting the machine takes about this much
MEMORY_TOLERANCE = 0.15  # the learner's estimate against the measured peak


@dataclass(frozen=True)
class Arch:
    """A Qwen2 decoder's shape: what the model is built from and the FLOPs counted from."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=4096,
            tie_word_embeddings=True,  # as Qwen2.5-1.5B
            pad_token_id=self.vocab - 1,  # synthetic tokens never use it
        )


@dataclass(frozen=True)
class Workload:
    arch: Arch
    samples: int  # per optimizer step, in groups of four
    prompt_len: int  # the longest prompt; each is 3/4 of it to all of it
    completion_len: int  # likewise
    steps: int  # measured steps, after one warm-up step
    micro_batch_tokens: int
    gen_rows: int  # engine batch: a third each on the base, job-a and job-b
    gen_prompt_len: int
    gen_tokens: int


QWEN25_1_5B = Arch(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936)
SIZES: dict[str, Workload] = {
    "1.5b": Workload(
        QWEN25_1_5B,
        samples=32,
        prompt_len=1024,
        completion_len=1024,
        steps=4,
        micro_batch_tokens=16384,
        gen_rows=24,
        gen_prompt_len=256,
        gen_tokens=128,
    ),
    # every part's code on a CPU in seconds; big enough that the memory model's terms dominate
    "tiny": Workload(
        Arch(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=2048),
        samples=8,
        prompt_len=24,
        completion_len=32,
        steps=2,
        micro_batch_tokens=160,
        gen_rows=6,
        gen_prompt_len=8,
        gen_tokens=6,
    ),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
JOBS = ("job-a", "job-b")

# Dense (no sparsity) bf16 tensor-core peaks in TFLOPS, from NVIDIA's data sheets (which
# quote twice these "with sparsity"), matched against torch.cuda.get_device_name() in
# this order (the first match wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGH200\b", 989.5),
    (r"\bH200 NVL\b", 835.5),
    (r"\bH200\b", 989.5),  # H200 SXM
    (r"\bH100 NVL\b", 835.5),
    (r"\bH100 PCIe\b", 756.5),
    (r"\bH100\b", 989.5),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (r"\bB200\b", 2250.0),
    (r"\bA100\b", 312.0),
    (r"\bL40S\b", 362.05),
    (r"\bL4\b", 121.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name; None when the table does not know it."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


# --- model FLOPs ------------------------------------------------------------------------


def decoder_weights(a: Arch) -> int:
    """N: the weights of the decoder layers' matrix multiplications (biases excluded)."""
    q = a.heads * a.head_dim
    kv = a.kv_heads * a.head_dim
    per_layer = a.hidden * q + 2 * a.hidden * kv + q * a.hidden + 3 * a.hidden * a.intermediate
    return a.layers * per_layer


def attention_flops(a: Arch, length: int) -> int:
    """Causal attention's forward: scores and weighted values over T (T + 1) / 2 pairs."""
    return 2 * a.layers * a.heads * a.head_dim * length * (length + 1)


def forward_flops(a: Arch, length: int, scored: int) -> int:
    return 2 * decoder_weights(a) * length + 2 * a.hidden * a.vocab * scored + attention_flops(a, length)


def step_flops(
    a: Arch, samples: Sequence[tuple[int, int]], *, lora_weights: int = 0, reference: bool = False
) -> int:
    """Model FLOPs of one optimizer step over ``samples`` (``(tokens, scored tokens)`` each):
    full weights (``lora_weights == 0``) or a LoRA adapter of ``lora_weights`` weights on a
    frozen base; ``reference``: the KL reference's forward runs too (module docstring)."""
    total = 0
    for length, scored in samples:
        f = forward_flops(a, length, scored)
        if lora_weights:
            total += 2 * f + attention_flops(a, length) + 6 * lora_weights * length
        else:
            total += 3 * f
        if reference:
            total += f
    return total


def mfu(flops: float, seconds: float, tflops: float) -> float:
    return flops / seconds / (tflops * 1e12)


# --- synthetic trajectories, models, memory --------------------------------------------


def sample_lengths(work: Workload, seed: int = 1) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of the synthetic samples: 3/4 of the longest to all of it."""
    rng = random.Random(seed)
    return [
        (
            rng.randint(work.prompt_len * 3 // 4, work.prompt_len),
            rng.randint(work.completion_len * 3 // 4, work.completion_len),
        )
        for _ in range(4 * max(1, work.samples // 4))
    ]


def synthetic_samples(work: Workload, seed: int = 1) -> list[Any]:
    """GRPO samples of random tokens in groups of four with rewards 1, 0, 0, 1 (group-
    normalised advantages), behaviour logprobs near a uniform policy's, so the ratios
    start near 1 as on-policy data does."""
    from temper.training.batch import Sample
    from temper.training.grpo import advantages

    rng = random.Random(seed + 1)
    vocab = work.arch.vocab
    rewards = [1.0, 0.0, 0.0, 1.0]
    advs = advantages(rewards)
    out = []
    for n, (p, c) in enumerate(sample_lengths(work, seed)):
        g, i = divmod(n, 4)
        ids = [rng.randrange(vocab - 1) for _ in range(p + c)]
        behaviour = [0.0] * p + [-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(c)]
        mask = [False] * p + [True] * c
        out.append(Sample(ids, mask, behaviour, advs[i], rewards[i], 0, f"e{g}.{i}", f"g{g}"))
    return out


def build_model(a: Arch, *, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """A Qwen2 model of shape ``a`` with seeded random weights, built on ``device`` (fp32
    unless ``dtype``)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)  # seeds every device's generator: ranks build the same weights
    with torch.device(device):
        model = Qwen2ForCausalLM(a.config())
    return model.to(dtype or torch.float32).eval()


def free(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device: torch.device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class LiveTensors:
    """Peak bytes of live tensor storage on a CPU (where no allocator keeps statistics):
    every storage an operation creates is counted until it is freed, beside the ones
    registered with :meth:`hold` (weights, optimizer state). Not used on CUDA, where
    ``torch.cuda.max_memory_allocated`` is the measurement."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    tracker.hold(t)
                return out

        self.mode = Mode()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, Any] = {}
        self.now = self.peak = 0

    def hold(self, t: Any) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.now += self.sizes[key]
        self.peak = max(self.peak, self.now)
        self.refs[key] = weakref.ref(storage, lambda _, key=key: self._gone(key))

    def _gone(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)


@contextlib.contextmanager
def peak_memory(
    device: torch.device, held: Callable[[], Iterator[torch.Tensor]]
) -> Iterator[Callable[[], int]]:
    """The peak bytes of the block: CUDA's allocator peak above what was allocated before
    ``held`` existed (the caller passes that as the baseline below), or on a CPU the live
    storage of ``held()`` plus everything the block allocates."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device)
        return
    live = LiveTensors()
    for t in held():
        live.hold(t)
    with live.mode:
        yield lambda: live.peak


def learner_tensors(learner: Any) -> Iterator[torch.Tensor]:
    import torch

    models = [learner.model] + ([learner.reference] if learner.reference is not None else [])
    for m in models:
        yield from m.parameters()
        yield from m.buffers()
        yield from (p.grad for p in m.parameters() if p.grad is not None)
    for state in learner.optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def micro_batch_sizes(samples: Sequence[Any], budget: int) -> list[tuple[int, int]]:
    """(padded tokens, scored tokens) of each micro-batch the learner makes of ``samples``."""
    from temper.training.batch import micro_batches

    return [
        (len(mb) * max(len(s.ids) for s in mb), sum(s.scored_tokens for s in mb))
        for mb in micro_batches(samples, budget)
    ]


# --- the parts --------------------------------------------------------------------------


@dataclass
class Result:
    figures: dict[str, Any]
    failed: list[str]
    line: str


def learner_variant(
    work: Workload, device: torch.device, *, lora: bool, deadline: float, tflops: float | None
) -> Result:
    """GRPO steps of the learner, full weights or LoRA: tokens/s, MFU, peak memory against
    the estimate. Steps stop early (one at least) when ``deadline`` (perf_counter) passes."""
    from temper.jobspec import LoraSpec
    from temper.training import Learner, LearnerConfig
    from temper.training.memory import GiB, estimate, model_shape

    name = "learner_lora" if lora else "learner_full"
    free(device)
    base = allocated(device)
    model = build_model(work.arch, device=device)
    spec = LoraSpec(rank=16, alpha=32, target_modules=LORA_TARGETS) if lora else None
    config = LearnerConfig(
        learning_rate=1e-5,
        kl_coef=0.05 if lora else 0.0,  # LoRA: the reference is the base, adapter off
        micro_batch_tokens=work.micro_batch_tokens,
        gradient_checkpointing=True,
        bf16=True,
        lora=spec,
    )
    learner = Learner(model, config, device=device)
    samples = synthetic_samples(work)
    failed: list[str] = []
    warm = learner.step_samples(samples)  # kernels chosen, AdamW's state allocated
    steps = []
    with peak_memory(device, functools.partial(learner_tensors, learner)) as peak:
        while not steps or (len(steps) < work.steps and time.perf_counter() < deadline):
            steps.append(learner.step_samples(samples))
        peak_bytes = peak() - base
    for s in [warm, *steps]:
        if not (s.updated and math.isfinite(s.loss)):
            failed.append(f"{name}: step {s.step} did not update (loss {s.loss}, grad norm {s.grad_norm})")
    shape = model_shape(learner.model)
    lora_weights = shape.trainable if lora else 0
    sizes = micro_batch_sizes(samples, config.micro_batch_tokens)
    planned = [
        estimate(
            shape,
            micro_batch_tokens=padded,
            scored_tokens=scored,
            gradient_checkpointing=True,
            bf16=learner.autocast_enabled,
            reference=learner.reference is not None,
        ).total
        for padded, scored in sizes
    ]
    est = max(planned)
    error = (est - peak_bytes) / peak_bytes
    if abs(error) > MEMORY_TOLERANCE:
        failed.append(
            f"{name}: estimate {est / GiB:.2f} GiB is {error:+.1%} off the peak {peak_bytes / GiB:.2f} GiB"
        )
    plan = learner.memory_plan.total  # the learner's own plan: every padded token scored
    if plan < peak_bytes:
        failed.append(
            f"{name}: the learner's plan {plan / GiB:.2f} GiB is below the peak {peak_bytes / GiB:.2f} GiB"
        )
    seconds = sum(s.seconds for s in steps)
    tokens = sum(s.tokens for s in steps)
    flops = len(steps) * step_flops(
        work.arch,
        [(len(s.ids), s.scored_tokens) for s in samples],
        lora_weights=lora_weights,
        reference=bool(config.kl_coef),
    )
    f: dict[str, Any] = {
        f"{name}_tokens_per_s": tokens / seconds,
        f"{name}_step_s": sorted(s.seconds for s in steps)[len(steps) // 2],
        f"{name}_steps": len(steps),
        f"{name}_tokens_per_step": tokens / len(steps),
        f"{name}_micro_batches": steps[-1].micro_batches,
        f"{name}_model_tflops": flops / seconds / 1e12,
        f"{name}_peak_gib": peak_bytes / GiB,
        f"{name}_estimate_gib": est / GiB,
        f"{name}_estimate_error": error,
        f"{name}_plan_gib": plan / GiB,
        f"{name}_params": shape.params,
        f"{name}_trainable": shape.trainable,
        f"{name}_loss": steps[-1].loss,
    }
    mfu_text = "MFU n/a (unknown peak)"
    if tflops:
        f[f"{name}_mfu"] = mfu(flops, seconds, tflops)
        mfu_text = f"MFU {f[f'{name}_mfu']:.1%}"
    line = (
        f"{'LoRA' if lora else 'full'} {tokens / seconds:,.0f} tokens/s, {mfu_text}, "
        f"peak {peak_bytes / GiB:.2f} GiB vs estimate {est / GiB:.2f} ({error:+.1%})"
    )
    return Result(f, failed, line)


def learner_part(work: Workload, device: torch.device, args: argparse.Namespace) -> Result:
    """Full weights, then LoRA; each records its figures as soon as it has them, and a
    variant that breaks (out of memory, say) is a failed check that leaves the other to run."""
    start = time.perf_counter()
    results = []
    for lora, share in ((False, 0.4), (True, 0.8)):
        try:
            r = learner_variant(
                work, device, lora=lora, deadline=start + args.part_limit_s * share, tflops=args.tflops
            )
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            what = "LoRA" if lora else "full"
            r = Result({}, [f"learner {what}: {type(exc).__name__}: {exc}"[:1000]], f"{what} error")
        record(args.out, r.figures)
        results.append(r)
    return Result(
        {k: v for r in results for k, v in r.figures.items()},
        [f for r in results for f in r.failed],
        "; ".join(r.line for r in results),
    )


def engine_part(work: Workload, device: torch.device, args: argparse.Namespace) -> Result:
    """One batch of the CPU engine's generate on the base and two adapters at once."""
    import torch

    from services.inference_gateway.cpu_server.runner import GenRequest, ModelRunner, SamplingParams
    from temper.jobspec import LoraSpec
    from temper.policy import default_tokenizer, pad_batch, token_logprobs
    from temper.training.lora import apply_lora
    from temper.training.memory import GiB

    a = work.arch
    bf16 = device.type == "cuda"
    free(device)
    base_bytes = allocated(device)
    base = build_model(a, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    spec = LoraSpec(rank=16, alpha=32, target_modules=LORA_TARGETS)
    with tempfile.TemporaryDirectory() as d:
        for n, job in enumerate(JOBS):
            adapter = apply_lora(copy.deepcopy(base), spec)
            gen = torch.Generator(device=device).manual_seed(100 + n)
            with torch.no_grad():
                for pname, p in adapter.named_parameters():
                    if "lora_B" in pname:  # PEFT starts B at zero: an adapter that changes the model
                        p.normal_(0, 0.02, generator=gen)
            adapter.save_pretrained(f"{d}/{job}")
            del adapter
        # the byte tokenizer decodes what it knows and skips the rest; text is not measured
        tok = default_tokenizer()
        # origin: this check never gives the base back, and a kept copy would double the memory
        engine = ModelRunner(base, tok, origin=lambda: (base, tok))
        for job in JOBS:
            engine.load_adapter(f"{d}/{job}", job_id=job, version=1)
    rng = random.Random(2)
    kinds: list[str | None] = [None, *JOBS]
    rows = [
        GenRequest(
            [rng.randrange(a.vocab - 1) for _ in range(work.gen_prompt_len)],
            SamplingParams(max_tokens=work.gen_tokens, temperature=1.0, seed=i, ignore_eos=True),
            job_id=kinds[i % 3],
        )
        for i in range(work.gen_rows)
    ]
    engine.generate([replace(r, params=replace(r.params, max_tokens=2)) for r in rows[:3]])  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    outs = engine.generate(rows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base_bytes) / GiB if device.type == "cuda" else 0.0
    failed = []
    names = {None: None, **{job: f"{job}-v1" for job in JOBS}}
    for i, (r, o) in enumerate(zip(rows, outs, strict=True)):
        if o.adapter != names[r.job_id] or len(o.token_ids) != work.gen_tokens:
            failed.append(f"engine: row {i} ran on {o.adapter} with {len(o.token_ids)} tokens")

    def forward_logprobs(model: Any, idx: list[int], adapter: str | None) -> list[list[float]]:
        """The rows' completions scored by the model's own forward with ``adapter`` alone."""
        got: list[list[float]] = []
        for k in range(0, len(idx), 4):  # a few rows at a time: [rows, T, V] fp32 logits
            chunk = [outs[i] for i in idx[k : k + 4]]
            ids, mask = pad_batch([o.prompt_ids + o.token_ids for o in chunk], 0)
            comp = torch.zeros_like(mask)
            for j, o in enumerate(chunk):
                comp[j, len(o.prompt_ids) : len(o.prompt_ids) + len(o.token_ids)] = 1
            off = model.disable_adapter() if adapter is None else contextlib.nullcontext()
            if adapter is not None:
                model.set_adapter(adapter)
            with torch.inference_mode(), off:
                lp = token_logprobs(model, ids.to(device), mask.to(device), comp.to(device)).cpu()
            got += [
                lp[j, len(o.prompt_ids) : len(o.prompt_ids) + len(o.token_ids)].tolist()
                for j, o in enumerate(chunk)
            ]
        return got

    own: list[float] = []
    other: list[float] = []
    adapters = [None, *(f"{job}-v1" for job in JOBS)]
    for n, adapter in enumerate(adapters):
        idx = [i for i, o in enumerate(outs) if o.adapter == adapter]
        wrong = adapters[(n + 1) % len(adapters)]
        for mine, theirs, i in zip(
            forward_logprobs(engine.model, idx, adapter),
            forward_logprobs(engine.model, idx, wrong),
            idx,
            strict=True,
        ):
            own += [abs(x - y) for x, y in zip(outs[i].logprobs, mine, strict=True)]
            other += [abs(x - y) for x, y in zip(outs[i].logprobs, theirs, strict=True)]
    own_mean, own_max, other_mean = sum(own) / len(own), max(own), sum(other) / len(other)
    mean_tol, max_tol = (0.05, 0.5) if bf16 else (1e-4, 1e-3)
    if own_mean > mean_tol or own_max > max_tol:
        failed.append(
            f"engine: logprobs off the forward by {own_mean:.4f} on average, {own_max:.4f} at most (tolerance {mean_tol}, {max_tol})"
        )
    if other_mean < 3 * own_mean or other_mean <= mean_tol:
        failed.append(
            f"engine: another adapter's forward is as close ({other_mean:.4f}) as the row's own ({own_mean:.4f})"
        )
    produced = sum(len(o.token_ids) for o in outs)
    f = {
        "engine_tokens_per_s": produced / seconds,
        "engine_rows": len(rows),
        "engine_prompt_tokens": work.gen_prompt_len,
        "engine_new_tokens": work.gen_tokens,
        "engine_generate_s": seconds,
        "engine_peak_gib": peak,
        "engine_logprob_mean_abs_diff": own_mean,
        "engine_logprob_max_abs_diff": own_max,
        "engine_other_adapter_mean_abs_diff": other_mean,
        "engine_dtype": "bfloat16" if bf16 else "float32",
    }
    line = (
        f"{len(rows)} rows (base, {', '.join(JOBS)}) x {work.gen_tokens} tokens: {produced / seconds:,.0f} tokens/s; "
        f"logprobs vs forward: mean |d| {own_mean:.4f}, max {own_max:.4f} (another adapter's: {other_mean:.4f})"
    )
    return Result(f, failed, line)


def fsdp_steps(work: Workload, device: torch.device, world: int) -> dict[str, Any]:
    """The learner's steps on the synthetic batch: in this process (``world`` 1, with the
    sharded learner's forward), or as one rank of ``world`` under torchrun with FSDP2."""
    import torch

    from temper.training import Learner, LearnerConfig

    if world > 1:
        from temper.training import distributed

        device = distributed.init(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the parts before ran in this process
    model = build_model(work.arch, device=device)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    config = LearnerConfig(
        learning_rate=1e-5, micro_batch_tokens=work.micro_batch_tokens, gradient_checkpointing=True
    )
    learner = Learner(model, config, device=device)
    if world > 1:
        distributed.shard(learner)
    else:
        learner.full_forward = True  # the same forward as the sharded learner's (logits everywhere)
    samples = synthetic_samples(work)
    stats = [learner.step_samples(samples) for _ in range(1 + work.steps)]
    measured = stats[1:]
    return {
        "world": world,
        "checksum": checksum,
        "losses": [s.loss for s in stats],
        "grad_norms": [s.grad_norm for s in stats],
        "tokens": sum(s.tokens for s in measured),
        "seconds": sum(s.seconds for s in measured),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
    }


def fsdp_rank(args: argparse.Namespace) -> int:
    """One torchrun rank of the fsdp part: rank 0 writes the figures to ``--out``."""
    import torch
    import torch.distributed as dist

    got = fsdp_steps(SIZES[args.size], torch.device(args.device), int(os.environ["WORLD_SIZE"]))
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(got))
    # wait for every rank, then leave without tearing the group down (gloo's teardown
    # sometimes aborts a rank after its work is done: tests/libs/training/batches.py)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fsdp_part(work: Workload, device: torch.device, args: argparse.Namespace) -> Result:
    import torch

    if device.type == "cuda":
        world = torch.cuda.device_count()
        if world < 2:
            why = f"{world} GPU visible: FSDP2 on NCCL needs 2 or more"
            return Result({"fsdp_skipped": why}, [], f"skipped: {why}")
    else:
        world = 2  # gloo ranks on the CPU: the code path only
    free(device)
    one = fsdp_steps(work, device, 1)
    free(device)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(Path(__file__).resolve()), "--fsdp-rank", "--size", args.size, "--device", device.type, "--out", str(out)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
        # a session of its own, so that a run past the limit is ended with every rank
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=args.part_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        if proc.returncode != 0 or not out.exists():
            return Result({}, [f"fsdp: torchrun exited {proc.returncode}: {log[-2000:]}"], "torchrun failed")
        many = json.loads(out.read_text())
    tol = 1e-2 if device.type == "cuda" else 1e-4  # bf16 autocast on CUDA; fp32 on the CPU
    failed = []
    if not math.isclose(many["checksum"], one["checksum"], rel_tol=1e-9):
        failed.append(
            f"fsdp: the ranks built other weights than one process ({many['checksum']} vs {one['checksum']})"
        )
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(many["losses"], one["losses"], strict=True))
    if worst > tol:
        failed.append(f"fsdp: losses {many['losses']} vs one process {one['losses']} (tolerance {tol})")
    per_gpu = many["tokens"] / many["seconds"] / world
    f = {
        "fsdp_ranks": world,
        "fsdp_tokens_per_s_per_rank": per_gpu,
        "fsdp_one_process_tokens_per_s": one["tokens"] / one["seconds"],
        "fsdp_loss_max_rel_diff": worst,
        "fsdp_steps": len(one["losses"]),
        "fsdp_peak_gib_rank0": many["peak_gib"],
        "fsdp_one_process_peak_gib": one["peak_gib"],
    }
    line = (
        f"{world} ranks: {per_gpu:,.0f} tokens/s per rank (one process: {f['fsdp_one_process_tokens_per_s']:,.0f}); "
        f"losses within {worst:.2e} of one process over {len(one['losses'])} steps"
    )
    return Result(f, failed, line)


RUN: dict[str, Callable[[Workload, torch.device, argparse.Namespace], Result]] = {
    "learner": learner_part,
    "engine": engine_part,
    "fsdp": fsdp_part,
}


# --- the plan ---------------------------------------------------------------------------

# What --plan assumes (to be replaced by the figures of a run on the device):
ASSUMED_MFU = 0.20  # of the H200's peak, for the learner's steps
IMPORT_S = 20.0  # python, torch, transformers and peft
BUILD_S = 20.0  # one model built on the device (or copied and saved, for an adapter)
DECODE_STEP_S = 0.1  # one engine step of the whole batch, CPU-side sampling included
TORCHRUN_S = 30.0  # torchrun and its ranks' imports
RECOMPUTE_S = 10.0  # the engine's rows scored again by the model's forward


def expected_seconds(work: Workload, part: str) -> float:
    """Expected seconds of a part on one H200 (two for fsdp), from the workload and the
    assumptions above."""
    lengths = [(p + c, c) for p, c in sample_lengths(work)]
    speed = ASSUMED_MFU * (peak_tflops("NVIDIA H200") or 0.0) * 1e12
    if part == "learner":
        full = step_flops(work.arch, lengths)
        lora = step_flops(work.arch, lengths, lora_weights=1, reference=True)
        return 2 * BUILD_S + (1 + work.steps) * (full + lora) / speed
    if part == "engine":
        return 3 * BUILD_S + (work.gen_tokens + 2) * DECODE_STEP_S + RECOMPUTE_S
    if part == "fsdp":
        return TORCHRUN_S + 2 * (BUILD_S + (1 + work.steps) * step_flops(work.arch, lengths) / speed)
    raise ValueError(part)


def plan(work: Workload, size: str) -> tuple[str, bool]:
    """The parts with their expected minutes, and whether the check fits the device budget."""
    n = decoder_weights(work.arch) + work.arch.hidden * work.arch.vocab
    tokens = sum(p + c for p, c in sample_lengths(work))
    what = {
        "learner": f"full weights, then LoRA r16 with KL: 1 warm-up + {work.steps} GRPO steps of "
        f"{work.samples} samples ({tokens:,} tokens, micro-batches of {work.micro_batch_tokens:,})",
        "engine": f"{work.gen_rows} rows (base, {', '.join(JOBS)}) x {work.gen_prompt_len} prompt + "
        f"{work.gen_tokens} new tokens, bf16; logprobs against the forward",
        "fsdp": "2+ GPUs: one process, then torchrun with FSDP2 on NCCL (skipped on one GPU, ~0 min)",
    }
    minutes = {p: expected_seconds(work, p) / 60 for p in PARTS}
    one_gpu = IMPORT_S / 60 + minutes["learner"] + minutes["engine"]
    left = DEVICE_BUDGET_MIN - MACHINE_START_MIN
    lines = [
        f"GPU check plan, size {size}: {n / 1e9:.2f}B-parameter Qwen2 body, vocabulary {work.arch.vocab:,}; "
        f"minutes on one H200 assuming {ASSUMED_MFU:.0%} MFU (bench/gpu_check.py, 'What --plan assumes')",
        *(f"  {p:<8} {minutes[p]:4.1f} min  {what[p]}" for p in PARTS),
        f"  total    {one_gpu:4.1f} min on one GPU ({one_gpu + minutes['fsdp']:.1f} with fsdp on 2+), "
        f"imports included; the device budget is {DEVICE_BUDGET_MIN:.0f} min, {left:.0f} after the machine starts",
    ]
    fits = one_gpu <= left and all(m <= 4.0 for m in minutes.values())
    lines.append(f"  fits: {'yes' if fits else 'NO'} (each part at most 4 min, the whole within {left:.0f})")
    return "\n".join(lines), fits


# --- running ----------------------------------------------------------------------------


def record(path: Path, figures: dict[str, Any]) -> None:
    """Merge ``figures`` into the results file now (so a run cut short keeps them)."""
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


# What temper's training library imports that a GPU machine's image lacks (with their
# own dependencies, the wheels of scripts/gpu_wheels.sh)
CARRIED = ("pydantic", "pydantic_settings", "orjson", "minio")


def missing_packages() -> list[str]:
    import importlib

    missing = []
    for name in CARRIED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--plan", action="store_true", help="print the parts and their expected minutes, run nothing"
    )
    p.add_argument("--part", choices=[*PARTS, "all"], default="all")
    p.add_argument("--size", choices=sorted(SIZES), default="1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--tflops", type=float, default=None, help="the device's dense bf16 peak (default: by its name)"
    )
    p.add_argument("--part-limit-s", type=float, default=240.0, help="a part starts no new step after this")
    p.add_argument("--fsdp-rank", action="store_true", help=argparse.SUPPRESS)  # torchrun's ranks
    args = p.parse_args(argv)
    work = SIZES[args.size]
    if args.plan:  # the standard library alone: it runs wherever python3 does
        text, fits = plan(work, args.size)
        print(text)
        return 0 if fits else 1
    missing = missing_packages()
    if missing:
        print(
            f"gpu_check: not installed here: {', '.join(missing)}, which temper's training library imports; "
            "run `bash scripts/gpu_wheels.sh` where pip can reach PyPI, carry .gpu-wheels/, then "
            "`make gpu-check` (which installs them into /tmp/temper-gpu-site)",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.fsdp_rank:
        return fsdp_rank(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; --device cpu runs every part's code on a CPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: threads only contend (CI has 2 cores)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.tflops is None and device.type == "cuda":
        args.tflops = peak_tflops(name)
    import peft
    import transformers

    record(
        args.out,
        {
            "device": name,
            "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "peak_bf16_tflops": args.tflops or 0.0,
            "size": args.size,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
    )
    failed_any = False
    for part in PARTS if args.part == "all" else [args.part]:
        t0 = time.perf_counter()
        try:
            result = RUN[part](work, device, args)
        except Exception as exc:  # noqa: BLE001 - a part that breaks is a failed check; the next one runs
            result = Result({}, [f"{part}: {type(exc).__name__}: {exc}"], "error")
        seconds = time.perf_counter() - t0
        ok = not result.failed
        record(
            args.out,
            {
                **result.figures,
                f"{part}_ok": ok,
                f"{part}_seconds": seconds,
                f"{part}_at": datetime.now(UTC).isoformat(timespec="seconds"),
                **({f"{part}_failed": "; ".join(result.failed)[:2000]} if not ok else {}),
            },
        )
        print(
            f"{part}: {result.line} [{seconds:.0f} s] {'ok' if ok else 'FAILED: ' + '; '.join(result.failed)}",
            flush=True,
        )
        failed_any |= not ok
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
