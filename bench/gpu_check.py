"""GPU check: LoRA and full GRPO steps, and the CPU engine's code generating with two
adapters on CUDA. Writes ``bench/results/gpu.json``.

Runs with the GPU machine's own torch, transformers and peft (no vLLM, no project venv):

    PYTHONPATH=libs:. python3 bench/gpu_check.py                 # every part, ~0.36B model
    PYTHONPATH=libs:. python3 bench/gpu_check.py --part lora     # one part on its own
    PYTHONPATH=libs:. python3 bench/gpu_check.py --size tiny --device cpu   # the code path, on a CPU

The model is Qwen2.5-0.5B's body (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864)
with seeded random weights and Temper's 264-token byte vocabulary (the engine decodes
what it samples, and no hub tokenizer is reachable): about 0.36B parameters. The
trainer keeps float32 master weights and runs forward/backward under bf16 autocast;
the engine runs the model in bf16. Each part merges its figures into the JSON file, so
parts can be run one at a time (each well under 6 minutes on one H200).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "gpu.json"
SIZES: dict[str, dict[str, int]] = {
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}


def build_model(size: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from temper.policy import default_tokenizer

    tok = default_tokenizer()
    cfg = Qwen2Config(
        vocab_size=tok.vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.stop_ids[0],
        pad_token_id=tok.pad_id,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def synthetic_samples(n: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> list[Any]:
    """GRPO samples with random tokens: groups of 4 with rewards 1,0,0,1 (advantages +-1)."""
    from temper.training.batch import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab - 8) for _ in range(prompt_len + completion_len)]
        mask = [False] * prompt_len + [True] * completion_len
        behaviour = [0.0] * prompt_len + [-5.0] * completion_len
        advantage = 1.0 if i % 4 in (0, 3) else -1.0
        out.append(Sample(ids, mask, behaviour, advantage, max(advantage, 0.0), 0, f"e{i}", f"g{i // 4}"))
    return out


def train_part(kind: str, args: argparse.Namespace) -> dict[str, float]:
    from temper.jobspec import LoraSpec
    from temper.training import Learner, LearnerConfig

    model = build_model(args.size)
    lora = (
        LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        if kind == "lora"
        else None
    )
    cfg = LearnerConfig(
        learning_rate=1e-5,
        kl_coef=0.05 if lora else 0.0,
        micro_batch_tokens=args.micro_batch_tokens,
        lora=lora,
    )
    learner = Learner(model, cfg, device=args.device)
    vocab = model.config.vocab_size
    samples = synthetic_samples(args.samples, args.prompt_len, args.completion_len, vocab, seed=1)
    learner.step_samples(samples[: min(4, len(samples))])  # warm-up: kernels, allocator
    if learner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, seconds = 0, 0.0
    for _ in range(args.steps):
        stats = learner.step_samples(samples)
        tokens += stats.tokens
        seconds += stats.seconds
    peak = torch.cuda.max_memory_allocated() / 2**30 if learner.device.type == "cuda" else 0.0
    return {f"{kind}_train_tokens_per_s": tokens / seconds, f"{kind}_peak_memory_gb": peak}


def generate_part(args: argparse.Namespace) -> dict[str, float]:
    from services.inference_gateway.cpu_server.runner import GenRequest, ModelRunner, SamplingParams
    from temper.jobspec import LoraSpec
    from temper.policy import default_tokenizer
    from temper.training.lora import apply_lora

    tok = default_tokenizer()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = ModelRunner(build_model(args.size).to(args.device, dtype), tok)
    spec = LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "v_proj"])
    with tempfile.TemporaryDirectory() as d:
        for n, job in enumerate(("job-a", "job-b")):
            peft_model = apply_lora(build_model(args.size), spec)
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.02, generator=torch.Generator().manual_seed(n))
            peft_model.save_pretrained(f"{d}/{job}")
            engine.load_adapter(f"{d}/{job}", job_id=job, version=1)
            del peft_model
    prompt = tok.encode("Write a function that adds two numbers.")
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=1.0, seed=0, ignore_eos=True)
    batch = [GenRequest(prompt, params, job_id=("job-a", "job-b")[i % 2]) for i in range(args.gen_batch)]
    engine.generate(batch[:2])  # warm-up
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert {o.adapter for o in outs} == {"job-a-v1", "job-b-v1"}, "both adapters served in the batch"
    produced = sum(len(o.token_ids) for o in outs)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    return {"generate_tokens_per_s": produced / seconds, "generate_peak_memory_gb": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["lora", "full", "generate", "all"], default="all")
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; use --device cpu for the code path only", file=sys.stderr)  # noqa: T201
        return 2
    figures: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    parts = ["lora", "full", "generate"] if args.part == "all" else [args.part]
    for part in parts:
        t0 = time.perf_counter()
        got = generate_part(args) if part == "generate" else train_part(part, args)
        got[f"{part}_seconds"] = time.perf_counter() - t0
        figures.update(got)
        print(json.dumps({part: got}), flush=True)  # noqa: T201
    peaks = [v for k, v in figures.items() if k.endswith("_peak_memory_gb")]
    figures["peak_memory_gb"] = max(peaks, default=0.0)
    # flat scalars, like every bench result (tests/test_bench_results.py)
    figures.update(
        {
            "size": args.size,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__,
            "samples": args.samples,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "steps": args.steps,
            "gen_batch": args.gen_batch,
            "gen_tokens": args.gen_tokens,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
