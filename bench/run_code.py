"""SandboxFusion-compatible ``POST /run_code`` throughput: a hello-world Python program
sent over real HTTP (keep-alive connections from a plain asyncio client) to a sandbox
worker in its own process (uvicorn, the worker's default settings: 8 zygotes, 8 actions at
once), by 1, 4, 16 and 64 clients; each request runs in pid, mount and IPC namespaces and
on a workspace no other request used (docs/sandbox.md, one-shot runs). The worker's and
the load generator's CPU per request at 16 clients are recorded too. The floor, in the same run: a bare bwrap with the
same namespaces and mounts started per request (no pool, no cgroup, no HTTP) by as many
at once as the worker runs, what one fresh sandbox per request costs at best here.

At 16 clients two workers are measured in alternating rounds of the same run: the default
one (``run_code_rps_c16``) and the same build with the per-run isolation pieces of issue 27
switched off by the benchmark-only ``TEMPER_SANDBOX__BENCH_PIECES_OFF``
(``run_code_rps_c16_off``: no read-only /dev and per-run /dev/shm and /dev/pts, no seccomp
filter, no kill before the fetch, no zygote memory checks or recycling); the ratio is
``run_code_c16_on_over_off`` (target >= 0.85).

    python bench/run_code.py             # prints the table; bench/sandbox.py merges the figures
    python bench/run_code.py --serve N   # the worker process the benchmark starts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]  # the worker child runs this file as a script
CONCURRENCY = (1, 4, 16, 64)
HELLO = {"code": "print('hello')", "language": "python"}


ROUNDS_C16 = 6  # alternating on/off rounds at 16 clients


def serve(port: int, root: Path, pieces_off: list[str]) -> None:
    """The worker: ``create_app`` around a started :class:`SandboxWorker`, on uvicorn."""
    import uvicorn

    from services.sandbox_worker.app import create_app
    from services.sandbox_worker.worker import SandboxWorker
    from temper.sandbox import SandboxSettings
    from temper.settings.sandbox import IsolationPiece
    from temper.storage import LocalStore

    async def main() -> None:
        settings = SandboxSettings(
            workspace_root=root / "ws", bench_pieces_off=[IsolationPiece(p) for p in pieces_off]
        )
        worker = SandboxWorker(settings, store=LocalStore(root / "objects"))
        await worker.start()
        try:
            config = uvicorn.Config(
                create_app(worker=worker), port=port, log_level="warning", access_log=False
            )
            await uvicorn.Server(config).serve()
        finally:
            await worker.close()

    asyncio.run(main())


async def _post_loop(
    host: str, port: int, body: bytes, take: Callable[[], bool], expect: str = "hello\n"
) -> tuple[list[float], int]:
    """One keep-alive HTTP/1.1 connection posting ``body`` to /run_code while ``take()``
    grants another request; the latencies (ms) and failures (not ``Success`` with stdout
    ``expect``). A plain client on asyncio streams: httpx cost 2.5 ms of CPU per request
    here (8.5 ms with 64 connections), as much as the worker's own share of these two cores."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /run_code HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    failed = 0
    try:
        while take():
            t0 = time.perf_counter()
            try:
                writer.write(head + body)
                status_line = await reader.readuntil(b"\r\n")
                length = 0
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    name, _, value = line.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                reply = json.loads(await reader.readexactly(length))
            except (asyncio.IncompleteReadError, ConnectionError):
                # the server closed the connection: a failed request, counted; go on on a new one
                failed += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            latencies.append((time.perf_counter() - t0) * 1000)
            ok = status_line.split()[1] == b"200" and reply.get("status") == "Success"
            if not ok or reply["run_result"]["stdout"] != expect:
                failed += 1
    finally:
        writer.close()
    return latencies, failed


async def _load(
    base: str, clients: int, requests: int, request: dict[str, str] = HELLO
) -> tuple[float, list[float], int]:
    """``requests`` POSTs of ``request`` (a hello world) by ``clients`` connections at once;
    requests/s, latencies (ms), failures."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(request).encode()
    left = requests

    def take() -> bool:
        nonlocal left
        left -= 1
        return left >= 0

    t0 = time.perf_counter()
    done = await asyncio.gather(*(_post_loop(host, int(port), body, take) for _ in range(clients)))
    elapsed = time.perf_counter() - t0
    return requests / elapsed, [ms for lat, _ in done for ms in lat], sum(f for _, f in done)


async def _floor(root: Path, at_once: int, runs: int) -> float:
    """Bare bwrap per request, ``at_once`` at a time: runs per second."""
    from bench.floor import as_sandbox_user, floor_workspace
    from temper.sandbox import SandboxLimits, SandboxSettings
    from temper.sandbox.backends import BwrapBackend

    settings = SandboxSettings(workspace_root=root / "floor")
    backend = BwrapBackend(settings)
    ws, uid = floor_workspace(root / "floor")
    argv = backend.floor_argv(ws, SandboxLimits())
    pre = as_sandbox_user(uid)

    gate = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with gate:
            proc = await asyncio.create_subprocess_exec(*argv, env={"PATH": "/usr/bin:/bin"}, preexec_fn=pre)
            assert await proc.wait() == 0

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(runs)))
    return runs / (time.perf_counter() - t0)


def _start_worker(root: Path, pieces_off: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    root.mkdir(parents=True)
    port = _free_port()
    argv = [sys.executable, __file__, "--serve", str(port), "--root", str(root)]
    if pieces_off:
        argv += ["--pieces-off", ",".join(pieces_off)]
    return subprocess.Popen(argv, cwd=ROOT), f"http://127.0.0.1:{port}"


async def measure(requests: int = 400) -> dict[str, float | int]:
    """Every figure: ``run_code_rps_c{N}``, their p50 latencies, the same build without the
    isolation pieces at 16 clients, the floor and failures."""
    from temper.settings.sandbox import IsolationPiece

    root = Path("/tmp") / f"temper-bench-runcode-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    root.chmod(0o711)
    on, on_base = _start_worker(root / "on")
    off, off_base = _start_worker(root / "off", tuple(p.value for p in IsolationPiece))
    out: dict[str, float | int] = {}
    try:
        for proc, base in ((on, on_base), (off, off_base)):
            await _wait_ready(base, proc)
            await _load(base, 4, 40)  # warm: imports, page cache, the pool
        failures = 0
        for clients in (c for c in CONCURRENCY if c != 16):
            n = max(requests // 2, 100) if clients == 1 else requests
            rps, latencies, failed = await _load(on_base, clients, n)
            out[f"run_code_rps_c{clients}"] = round(rps, 1)
            out[f"run_code_ms_c{clients}"] = round(statistics.median(latencies), 2)
            failures += failed
        # 16 clients: the default worker and the one without the pieces, in alternating
        # rounds (each goes first in half of them), so machine noise hits both alike.
        rounds: dict[str, dict[str, list[float]]] = {
            name: {"rps": [], "ms": [], "cpu": [], "client": []} for name in ("on", "off")
        }
        for i in range(ROUNDS_C16):
            pair = [("on", on, on_base), ("off", off, off_base)]
            for name, proc, base in pair if i % 2 == 0 else pair[::-1]:
                cpu0, own0 = _cpu_s(proc.pid), time.process_time()
                rps, latencies, failed = await _load(base, 16, requests)
                got = rounds[name]
                got["rps"].append(rps)
                got["ms"] += latencies
                got["cpu"].append((_cpu_s(proc.pid) - cpu0) * 1000 / requests)
                got["client"].append((time.process_time() - own0) * 1000 / requests)
                failures += failed
        for name, suffix in (("on", ""), ("off", "_off")):
            got = rounds[name]
            out[f"run_code_rps_c16{suffix}"] = round(statistics.median(got["rps"]), 1)
            out[f"run_code_ms_c16{suffix}"] = round(statistics.median(got["ms"]), 2)
            out[f"run_code_worker_cpu_ms_c16{suffix}"] = round(statistics.median(got["cpu"]), 2)
        out["run_code_client_cpu_ms_c16"] = round(statistics.median(rounds["on"]["client"]), 2)
        out["run_code_c16_on_over_off"] = round(
            float(out["run_code_rps_c16"]) / float(out["run_code_rps_c16_off"]), 3
        )
        out["run_code_c16_rounds"] = ROUNDS_C16
        out["run_code_failed"] = failures
    finally:
        for proc in (on, off):
            proc.terminate()
        for proc in (on, off):
            proc.wait(timeout=30)
    try:
        await _floor(root, 8, 20)
        out["floor_bwrap_rps"] = round(await _floor(root, 8, requests), 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["run_code_c16_over_floor"] = round(float(out["run_code_rps_c16"]) / float(out["floor_bwrap_rps"]), 3)
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (the worker; its sandboxes are not its
    children in /proc's accounting: they come from the spawner)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=2) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the sandbox worker exited with {proc.returncode}")
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the sandbox worker did not answer /health in time")


def table(res: dict[str, float | int]) -> list[tuple[str, str, str]]:
    rows = [
        (f"run_code hello world, {c} client(s) (req/s)", f"{res[f'run_code_rps_c{c}']}",
         f"p50 {res[f'run_code_ms_c{c}']} ms")
        for c in CONCURRENCY
    ]  # fmt: skip
    rows.append(
        (
            "  ... 16 clients, isolation pieces off (req/s)",
            f"{res['run_code_rps_c16_off']}",
            f"p50 {res['run_code_ms_c16_off']} ms, benchmark-only build",
        )
    )
    rows.append(("run_code c16 on / off", f"{res['run_code_c16_on_over_off']}", "target >= 0.85"))
    rows.append(
        (
            "worker CPU per request at 16 clients (ms)",
            f"{res['run_code_worker_cpu_ms_c16']}",
            f"HTTP + run_fresh (pieces off: {res['run_code_worker_cpu_ms_c16_off']})",
        )
    )
    rows.append(
        ("load generator CPU per request at 16 (ms)", f"{res['run_code_client_cpu_ms_c16']}", "same cores")
    )
    rows.append(("bare bwrap per request, 8 at once (runs/s)", f"{res['floor_bwrap_rps']}", "the floor"))
    rows.append(("run_code c16 / floor", f"{res['run_code_c16_over_floor']}", "target: c16 >= 180 req/s"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int, help="run the worker on this port (the benchmark's child)")
    parser.add_argument("--root", type=Path)
    parser.add_argument("--pieces-off", default="", help="the worker's bench_pieces_off, comma-separated")
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.root, [p for p in args.pieces_off.split(",") if p])
        return
    res = asyncio.run(measure(args.requests))
    rows = table(res)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(f"failed requests: {res['run_code_failed']}")


if __name__ == "__main__":
    main()
