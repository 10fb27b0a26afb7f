"""``python -m services.inference_gateway.cpu_server --preset tiny --port 8010`` (or ``--model-dir DIR``)."""

from __future__ import annotations

import argparse
import logging
import os

import torch
import uvicorn

from services.inference_gateway.cpu_server.app import create_app
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import build_runner
from temper.settings import get_settings
from temper.storage import make_store


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.inference_gateway.cpu_server")
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--model-dir", help="a Hugging Face model directory (config, safetensors, tokenizer + chat template)"
    )
    src.add_argument("--preset", default="tiny", help="create a model with random weights (default: tiny)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed for --preset")
    ap.add_argument("--model-name", default="temper-policy")
    # compose and k8s start it without flags: TEMPER_HOST/TEMPER_PORT, as every service reads them
    ap.add_argument("--host", default=os.environ.get("TEMPER_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("TEMPER_PORT", "8010")))
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--batch-window-ms", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    runner = build_runner(model_dir=args.model_dir, preset=args.preset, seed=args.seed)
    settings = get_settings()
    sched = BatchScheduler(runner, max_batch=args.max_batch, window_ms=args.batch_window_ms)
    app = create_app(
        sched,
        model_name=args.model_name,
        store=make_store(settings),
        cache_dir=settings.data_dir / "cpu-server-checkpoints",
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
