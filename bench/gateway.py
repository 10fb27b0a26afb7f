"""Gateway overhead: the same CPU engine called directly and through the gateway, in one run.

Starts one engine (``--preset tiny``) and one gateway in front of it as subprocesses,
then measures
- latency: sequential 1-token completions, direct and via the gateway alternately;
- throughput: ``--concurrency`` clients, ``--tokens``-token completions, direct then gateway
  (several rounds, alternated, the median kept);
- the engine's weight-switch time (``POST /v1/load_weights`` of a saved checkpoint).
Writes ``bench/results/gateway.json`` (flat) and prints a table.

    python bench/gateway.py [--requests 200] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], env: dict[str, str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{url} did not come up")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def latency(direct: str, gateway: str, body: dict, n: int) -> tuple[list[float], list[float]]:
    d, g = [], []
    async with httpx.AsyncClient(timeout=30) as c:
        for url in (direct, gateway):  # warm both paths
            for _ in range(10):
                (await c.post(f"{url}/v1/completions", json=body)).raise_for_status()
        for i in range(n):
            for url, out in ((direct, d), (gateway, g)) if i % 2 == 0 else ((gateway, g), (direct, d)):
                t0 = time.perf_counter()
                r = await c.post(f"{url}/v1/completions", json=body)
                out.append((time.perf_counter() - t0) * 1000)
                r.raise_for_status()
    return d, g


async def throughput(url: str, body: dict, n: int, concurrency: int) -> float:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                queue.pop()
                (await c.post(f"{url}/v1/completions", json=body)).raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200, help="sequential requests per path for latency")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--throughput-requests", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.json"))
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="temper-bench-gw-"))
    eport, gport = free_port(), free_port()
    engine_url, gw_url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "libs")]),
           "TEMPER_DATA_DIR": str(tmp), "TEMPER_STORAGE__ROOT": str(tmp / "objects"),
           "TEMPER_INFERENCE__BACKENDS": json.dumps([{"name": "engine-0", "url": engine_url}]),
           "TEMPER_INFERENCE__MAX_INFLIGHT_PER_BACKEND": "64",
           "TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR": str(tmp / "cache")}
    procs = []
    try:
        procs.append(start(["-m", "services.inference_gateway.engine", "--preset", "tiny", "--port", str(eport),
                            "--threads", "1"], env, engine_url))
        procs.append(start(["-m", "services.inference_gateway", "--port", str(gport)], env, gw_url))
        tok = default_tokenizer()
        prompt = encode_chat(tok, [{"role": "user", "content": "benchmark the gateway"}])
        one = {"prompt": prompt, "max_tokens": 1, "seed": 1, "logprobs": 0, "return_token_ids": True}
        d, g = asyncio.run(latency(engine_url, gw_url, one, args.requests))
        many = {**one, "max_tokens": args.tokens, "ignore_eos": True}
        direct_rps, gw_rps = [], []
        for _ in range(args.rounds):
            direct_rps.append(asyncio.run(throughput(engine_url, many, args.throughput_requests, args.concurrency)))
            gw_rps.append(asyncio.run(throughput(gw_url, many, args.throughput_requests, args.concurrency)))
        ckpt = save_checkpoint(create_model(seed=7), tmp / "ckpt")
        switches = []
        for v in range(1, 6):
            r = httpx.post(f"{engine_url}/v1/load_weights", json={"path": str(ckpt), "version": v}, timeout=60)
            r.raise_for_status()
            switches.append(r.json()["switch_ms"])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    res = {
        "direct_p50_ms": round(statistics.median(d), 3),
        "gateway_p50_ms": round(statistics.median(g), 3),
        "direct_p99_ms": round(pct(d, 0.99), 3),
        "gateway_p99_ms": round(pct(g, 0.99), 3),
        "added_p50_ms": round(statistics.median(g) - statistics.median(d), 3),
        "added_p99_ms": round(pct(g, 0.99) - pct(d, 0.99), 3),
        "direct_rps": round(statistics.median(direct_rps), 2),
        "gateway_rps": round(statistics.median(gw_rps), 2),
        "throughput_ratio": round(statistics.median(gw_rps) / statistics.median(direct_rps), 3),
        "weight_switch_ms": round(statistics.median(switches), 3),
        "latency_requests": args.requests,
        "throughput_requests": args.throughput_requests,
        "concurrency": args.concurrency,
        "tokens_per_request": args.tokens,
        "cpus": os.cpu_count(),
        "model": "tiny (Qwen2, 2 layers, hidden 128)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    width = max(len(k) for k in res)
    print("gateway benchmark (same CPU engine, direct vs via gateway)")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v}")
    print(f"targets: added_p50_ms <= 1.0 -> {'ok' if res['added_p50_ms'] <= 1.0 else 'MISSED'}; "
          f"throughput_ratio >= 0.95 -> {'ok' if res['throughput_ratio'] >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
