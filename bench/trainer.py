"""GRPO training throughput: Temper's Learner and TRL's GRPOTrainer on the same model,
batch and sequence lengths, in one run.

Both train the example policy (the ``tiny`` preset: a Qwen2ForCausalLM over the byte
tokenizer, saved as a local model directory) on batches of ``--groups`` groups x
``--group-size`` samples, each ``--prompt-len`` prompt tokens + ``--completion-len``
completion tokens, with the same learning rate, clip range, gradient clipping, no KL
term, AdamW, float32 on CPU (bf16 on a GPU), and the same number of torch threads.

What is timed is the training step alone: forward, backward, gradient clipping and
the optimizer step. TRL's GRPOTrainer also samples the completions inside its step
(``model.generate``); that time is measured separately, subtracted, and reported
(``trl_generation_s_per_step``), because Temper's trainer never generates (the
inference fleet does). Completions are forced to exactly ``--completion-len`` tokens
(``min_new_tokens``) so both see the same sequence lengths. tokens/s counts every real
(non-pad) prompt and completion token of a step, divided by the median training time
of a step (the median resists other processes' bursts on a shared machine);
``*_tokens_per_cpu_s`` divides the total by the CPU time the process spent instead
(both are reported, with the load average).
TRL runs with ``gradient_checkpointing=False`` (its default is True, which recomputes
activations in the backward pass; Temper does not).

TRL and accelerate are bench-only dependencies: the ``bench`` extra of pyproject.toml,
pinned in requirements.lock and installed by ``make setup``; never installed at run
time. It runs offline (local model directory, in-memory dataset, HF_HUB_OFFLINE=1).

FSDP: the same Learner step on the same global batch, sharded with FSDP2 over 2
processes under ``torchrun`` (gloo, CPU; each process with half the torch threads), against
the one-process figure above: ``fsdp_tokens_per_s`` (the batch's tokens over the median
step time of rank 0) and ``fsdp_ratio`` (that over ``temper_tokens_per_s``). On one small
CPU machine this measures what sharding costs (the collectives), not what it buys: its
use is a model that does not fit one device.

    python bench/trainer.py [--steps 6] [--warmup 1] [--preset tiny] [--fsdp-only]

Writes ``bench/results/trainer.json`` (``--fsdp-only``: Temper one process against two,
no TRL, to ``bench/results/trainer-fsdp.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

import torch  # noqa: E402

from temper.policy import create_model, default_tokenizer, save_checkpoint  # noqa: E402
from temper.training import Learner, LearnerConfig, Sample  # noqa: E402
from temper.training.grpo import group_advantages  # noqa: E402

LR, CLIP, MAX_GRAD_NORM = 1e-5, 0.2, 1.0


def require_trl() -> str:
    """TRL's version; exits with what to do when TRL or accelerate is missing."""
    try:
        import accelerate  # noqa: F401  (TRL's Trainer needs it)
        import trl
    except ImportError as exc:
        sys.exit(
            f"bench/trainer.py needs the bench extra ({exc.name} is missing): "
            "run `make setup`, or install it from the lock: pip install -c requirements.lock '.[bench]'"
        )
    return str(trl.__version__)


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two measurements of the same thing: throughputs from the summed raw numbers."""
    tokens = a["tokens"] + b["tokens"]
    step_s = statistics.median([*a["step_s"], *b["step_s"]])
    return {
        "tokens_per_s": a["tokens_per_step"] / step_s,
        "tokens_per_cpu_s": tokens / (a["cpu_seconds"] + b["cpu_seconds"]),
        "s_per_step": step_s,
        "tokens_per_step": a["tokens_per_step"],
    }


def temper_bench(
    args: argparse.Namespace, device: torch.device, *, steps: int, sharded: bool = False
) -> dict[str, Any]:
    tok = default_tokenizer()
    rng = random.Random(0)  # every rank of a sharded run draws the same global batches
    learner = Learner(
        create_model(args.preset, seed=0),
        LearnerConfig(
            learning_rate=LR,
            clip_eps=CLIP,
            max_grad_norm=MAX_GRAD_NORM,
            kl_coef=0.0,
            micro_batch_tokens=1 << 20,
        ),
        device=device,
    )
    if sharded:
        from temper.training.distributed import shard

        shard(learner)

    def batch() -> list[Sample]:
        samples = []
        for _ in range(args.groups):
            rewards = [rng.random() for _ in range(args.group_size)]
            prompt = [tok.bos_id or 0] + [rng.randrange(32, 127) for _ in range(args.prompt_len - 1)]
            for r, adv in zip(rewards, group_advantages(rewards), strict=True):
                completion = [rng.randrange(32, 127) for _ in range(args.completion_len)]
                ids = prompt + completion
                mask = [False] * len(prompt) + [True] * len(completion)
                # behaviour logprobs a little off the current policy, so the ratio is not 1
                old = [0.0] * len(prompt) + [-5.6 + rng.uniform(-0.1, 0.1) for _ in completion]
                samples.append(Sample(ids, mask, old, adv, r))
        return samples

    times, cpu, tokens = [], [], []
    for i in range(args.warmup + steps):
        samples = batch()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        stats = learner.step_samples(samples, groups=args.groups)
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        assert stats.updated
        if i >= args.warmup:
            times.append(elapsed)
            cpu.append(cpu_s)
            tokens.append(stats.tokens)
    return {
        "tokens": sum(tokens),
        "seconds": sum(times),
        "cpu_seconds": sum(cpu),
        "step_s": times,
        "tokens_per_step": statistics.median(tokens),
    }


def fsdp_worker(args: argparse.Namespace) -> None:
    """One rank of the sharded measurement (under torchrun); rank 0 writes the result."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = temper_bench(args, torch.device("cpu"), steps=args.steps, sharded=True)
    if dist.get_rank() == 0:
        Path(args.fsdp_worker).write_text(json.dumps(result))
    dist.destroy_process_group()


def fsdp_bench(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """The same steps, sharded over 2 processes with ``threads // 2`` threads each."""
    import subprocess

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "fsdp.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--fsdp-worker", str(out), "--preset", args.preset, "--groups", str(args.groups),
                   "--group-size", str(args.group_size), "--prompt-len", str(args.prompt_len),
                   "--completion-len", str(args.completion_len), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // 2))}
        subprocess.run(command, env=env, check=True, timeout=900)
        return dict(json.loads(out.read_text()))


def trl_bench(args: argparse.Namespace, device: torch.device, model_dir: Path) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    tokenizer.padding_side = "left"
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(rng.choice(alphabet) for _ in range(args.prompt_len)) for _ in range(512)]
    dataset = Dataset.from_dict({"prompt": prompts})
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def reward(completions: list[str], **_: object) -> list[float]:
        return [rng.random() for _ in completions]

    on_gpu = device.type == "cuda"
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.groups * args.group_size,
            num_generations=args.group_size,
            max_completion_length=args.completion_len,
            generation_kwargs={"min_new_tokens": args.completion_len},
            learning_rate=LR,
            epsilon=CLIP,
            max_grad_norm=MAX_GRAD_NORM,
            beta=0.0,
            loss_type="dapo",  # token-level averaging, like Temper
            gradient_checkpointing=False,  # TRL's default is True; Temper does not recompute activations
            max_steps=args.warmup + args.steps,
            lr_scheduler_type="constant",
            warmup_steps=0,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=not on_gpu,
            bf16=on_gpu,
            seed=0,
            dataloader_num_workers=0,
        )

        class Timed(GRPOTrainer):
            generation_s: list[float] = []
            generation_cpu: list[float] = []
            step_tokens: list[int] = []

            def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
                if on_gpu:
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                out = super()._generate_and_score_completions(inputs)
                if on_gpu:
                    torch.cuda.synchronize()
                self.generation_s.append(time.perf_counter() - t0)
                self.generation_cpu.append(time.process_time() - c0)
                self.step_tokens.append(int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
                return out

        step_s: list[float] = []
        step_cpu: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):  # type: ignore[no-untyped-def]
                if on_gpu:
                    torch.cuda.synchronize()
                self.t0, self.c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, *a, **k):  # type: ignore[no-untyped-def]
                if on_gpu:
                    torch.cuda.synchronize()
                step_s.append(time.perf_counter() - self.t0)
                step_cpu.append(time.process_time() - self.c0)

        trainer = Timed(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.train()
    gen = Timed.generation_s[args.warmup :]
    tokens = Timed.step_tokens[args.warmup :]
    train = [s - g for s, g in zip(step_s[args.warmup :], gen, strict=True)]
    train_cpu = [
        s - g for s, g in zip(step_cpu[args.warmup :], Timed.generation_cpu[args.warmup :], strict=True)
    ]
    return {
        "tokens_per_s": statistics.median(tokens) / statistics.median(train),
        "tokens_per_cpu_s": sum(tokens) / sum(train_cpu),
        "s_per_step": statistics.median(train),
        "tokens_per_step": int(statistics.median(tokens)),
        "generation_s_per_step": statistics.median(gen),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--fsdp-only", action="store_true", help="Temper on 1 process against 2, no TRL")
    ap.add_argument("--fsdp-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fsdp_worker:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        fsdp_worker(args)
        return
    name = "trainer-fsdp.json" if args.fsdp_only else "trainer.json"
    args.out = args.out or str(ROOT / "bench" / "results" / name)
    if args.fsdp_only:
        fsdp_only(args)
        return

    trl_version = require_trl()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        model_dir = Path(d) / "policy"
        save_checkpoint(create_model(args.preset, seed=0), model_dir)
        # Temper is measured in two halves, before and after TRL, so that a change in the
        # machine's load during the run weighs on both sides alike.
        first = temper_bench(args, device, steps=(args.steps + 1) // 2)
        trl = trl_bench(args, device, model_dir)
        second = temper_bench(args, device, steps=args.steps // 2) if args.steps > 1 else first
        temper = merge(first, second)
    fsdp = fsdp_bench(args, threads)
    fsdp_tokens_per_s = fsdp["tokens_per_step"] / statistics.median(fsdp["step_s"])

    params = sum(p.numel() for p in create_model(args.preset, seed=0).parameters())
    result = {
        "temper_tokens_per_s": round(temper["tokens_per_s"], 1),
        "trl_tokens_per_s": round(trl["tokens_per_s"], 1),
        "ratio": round(temper["tokens_per_s"] / trl["tokens_per_s"], 3),
        "temper_tokens_per_cpu_s": round(temper["tokens_per_cpu_s"], 1),
        "trl_tokens_per_cpu_s": round(trl["tokens_per_cpu_s"], 1),
        "ratio_cpu": round(temper["tokens_per_cpu_s"] / trl["tokens_per_cpu_s"], 3),
        "temper_s_per_step": round(temper["s_per_step"], 4),
        "trl_s_per_step": round(trl["s_per_step"], 4),
        "trl_generation_s_per_step": round(trl["generation_s_per_step"], 4),
        "fsdp_tokens_per_s": round(fsdp_tokens_per_s, 1),
        "fsdp_ratio": round(fsdp_tokens_per_s / temper["tokens_per_s"], 3),
        "fsdp_processes": 2,
        "temper_tokens_per_step": temper["tokens_per_step"],
        "trl_tokens_per_step": trl["tokens_per_step"],
        "model": f"{args.preset} (Qwen2ForCausalLM, {params} parameters)",
        "batch_groups": args.groups,
        "batch_group_size": args.group_size,
        "batch_prompt_len": args.prompt_len,
        "batch_completion_len": args.completion_len,
        "steps_measured": args.steps,
        "warmup_steps": args.warmup,
        "device": str(device),
        "dtype": "bf16 autocast" if device.type == "cuda" else "float32",
        "torch_threads": threads,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "trl": trl_version,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        "timed": "forward+backward+grad clip+AdamW step; TRL's generation inside its step is timed apart and excluded",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        ("", "Temper", "TRL GRPOTrainer"),
        (
            "tokens/s (training)",
            f"{result['temper_tokens_per_s']:,.0f}",
            f"{result['trl_tokens_per_s']:,.0f}",
        ),
        (
            "tokens per CPU-second",
            f"{result['temper_tokens_per_cpu_s']:,.0f}",
            f"{result['trl_tokens_per_cpu_s']:,.0f}",
        ),
        ("s/step (training)", f"{result['temper_s_per_step']:.3f}", f"{result['trl_s_per_step']:.3f}"),
        ("tokens/step", f"{result['temper_tokens_per_step']:,}", f"{result['trl_tokens_per_step']:,}"),
        ("s/step generating (excluded)", "-", f"{result['trl_generation_s_per_step']:.3f}"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print(
        f"GRPO training, {result['model']}, {args.groups}x{args.group_size} sequences of "
        f"{args.prompt_len}+{args.completion_len} tokens, {device}, {threads} threads"
    )
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width, strict=True))
            )
        )
    print(
        f"ratio (Temper / TRL): {result['ratio']:.2f} wall-clock, {result['ratio_cpu']:.2f} per CPU-second"
        f"   -> {args.out}"
    )
    print(
        f"FSDP2, 2 gloo processes: {result['fsdp_tokens_per_s']:,.0f} tokens/s, {result['fsdp_ratio']:.2f}x one process"
    )


def fsdp_only(args: argparse.Namespace) -> None:
    """Temper's step on one process against the same steps sharded over two (no TRL)."""
    threads = torch.get_num_threads()
    one = temper_bench(args, torch.device("cpu"), steps=args.steps)
    two = fsdp_bench(args, threads)
    one_tps = one["tokens_per_step"] / statistics.median(one["step_s"])
    two_tps = two["tokens_per_step"] / statistics.median(two["step_s"])
    result = {
        "temper_tokens_per_s": round(one_tps, 1),
        "fsdp_tokens_per_s": round(two_tps, 1),
        "fsdp_ratio": round(two_tps / one_tps, 3),
        "fsdp_processes": 2,
        "tokens_per_step": one["tokens_per_step"],
        "model": args.preset,
        "batch": f"{args.groups}x{args.group_size} of {args.prompt_len}+{args.completion_len} tokens",
        "steps_measured": args.steps,
        "warmup_steps": args.warmup,
        "torch_threads": threads,
        "threads_per_fsdp_process": max(1, threads // 2),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
