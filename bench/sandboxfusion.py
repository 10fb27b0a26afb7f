"""Temper's ``POST /run_code`` beside SandboxFusion's, in one run on this machine
(``make bench-sandboxfusion``; not in CI).

SandboxFusion is not built or started here: give the URL of one already running
(``--sandboxfusion URL`` or ``SANDBOXFUSION_URL``; ``../shared/FACTS.md`` says how it was run on
this machine kind) and, to count its server's CPU, its process id (``--sandboxfusion-pid``).
Temper's worker is started by the benchmark with its default settings (bench/run_code.py's).

Both get the same hello-world Python request from the same plain keep-alive asyncio client
(bench/run_code.py's), first checked to answer ``Success`` with ``hello``. SandboxFusion's
plateau is the best of its median rates at 4, 16 and 64 clients; each of six rounds measures
Temper's ``run_code_rps_c16`` and SandboxFusion at 4, 16 and 64 clients, in an order that
turns from round to round, so a change in the machine's load hits both alike. Every round also counts the whole
machine's CPU (``/proc/stat``) per request, and for Temper where it went: the worker process
(HTTP, the run's bookkeeping), the sandboxes' cgroups (the zygotes: each run's forks,
namespaces, mounts and the program), the load generator, and the rest (the spawner, kernel
threads, anything else running).

    python bench/sandboxfusion.py --sandboxfusion http://127.0.0.1:8080 [--sandboxfusion-pid PID]

Writes bench/results/sandboxfusion.json (flat) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from bench import run_code  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "sandboxfusion.json"
ROUNDS = 6  # alternating rounds at 16 clients
PLATEAU_CLIENTS = (4, 16, 64)
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int, int]:
    """(busy, user, system) clock ticks of every CPU since boot: user + nice + system +
    irq + softirq + steal as busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal, user + nice, system + irq + softirq


def process_ms(pid: int, children: bool = False) -> float:
    """CPU ms of process ``pid`` (with its waited-for children when ``children``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks * TICK_MS


def sandboxes_ms(worker_pid: int) -> float | None:
    """CPU ms of every sandbox of the worker: its ``temper-<pid>`` cgroup (cpuacct on cgroup
    v1, cpu.stat on v2), which holds every zygote and one-shot sandbox it started."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    for _dev, point, kind, options, *_ in mounts:
        if kind == "cgroup" and "cpuacct" in options.split(","):
            for found in Path(point).rglob(f"temper-{worker_pid}"):
                return int((found / "cpuacct.usage").read_text()) / 1e6
        if kind == "cgroup2":
            for found in Path(point).rglob(f"temper-{worker_pid}"):
                stat = dict(line.split() for line in (found / "cpu.stat").read_text().splitlines())
                return int(stat["usage_usec"]) / 1e3
    return None


async def check(base: str) -> None:
    """The server answers hello world as SandboxFusion does, or the figures mean nothing."""
    _, latencies, failed = await run_code._load(base, 1, 3)
    if failed:
        raise SystemExit(f"{base}/run_code does not answer hello world with Success and 'hello\\n'")


async def round_of(
    base: str, clients: int, requests: int, worker_pid: int | None, fusion_pid: int | None
) -> dict:
    busy0, user0, sys0 = machine_ticks()
    own0 = time.process_time()
    worker0 = process_ms(worker_pid) if worker_pid else 0.0
    boxes0 = (sandboxes_ms(worker_pid) or 0.0) if worker_pid else 0.0
    fusion0 = process_ms(fusion_pid, children=True) if fusion_pid else 0.0
    rps, latencies, failed = await run_code._load(base, clients, requests)
    busy1, user1, sys1 = machine_ticks()
    got = {
        "rps": rps,
        "ms": statistics.median(latencies),
        "failed": failed,
        "machine_ms": (busy1 - busy0) * TICK_MS / requests,
        "user_ms": (user1 - user0) * TICK_MS / requests,
        "system_ms": (sys1 - sys0) * TICK_MS / requests,
        "client_ms": (time.process_time() - own0) * 1000 / requests,
    }
    if worker_pid:
        got["worker_ms"] = (process_ms(worker_pid) - worker0) / requests
        got["sandboxes_ms"] = ((sandboxes_ms(worker_pid) or 0.0) - boxes0) / requests
    if fusion_pid:
        got["server_ms"] = (process_ms(fusion_pid, children=True) - fusion0) / requests
    return got


def med(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


async def measure(fusion: str, fusion_pid: int | None, requests: int) -> dict[str, float | int | str]:
    root = Path("/tmp") / f"temper-bench-fusion-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    root.chmod(0o711)
    proc, temper = run_code._start_worker(root / "temper")
    out: dict[str, float | int | str] = {}
    load0 = os.getloadavg()[0]
    try:
        await run_code._wait_ready(temper, proc)
        await check(temper)
        await check(fusion)
        await run_code._load(temper, 4, 40)  # warm: imports, page cache, the zygotes
        await run_code._load(fusion, 4, 20)
        fusion_requests = max(100, requests // 3)  # about as long a round at a third of the rate
        # Each round: Temper at 16 clients and SandboxFusion at 4, 16 and 64, in an order
        # that turns from round to round.
        rounds: dict[str, list[dict]] = {"temper": [], **{f"fusion{c}": [] for c in PLATEAU_CLIENTS}}
        for i in range(ROUNDS):
            turn: list[tuple[str, str, int, int, int | None, int | None]] = [
                ("temper", temper, 16, requests, proc.pid, None),
                *((f"fusion{c}", fusion, c, fusion_requests, None, fusion_pid) for c in PLATEAU_CLIENTS),
            ]
            turn = turn[i % len(turn) :] + turn[: i % len(turn)]
            for name, base, clients, n, wpid, fpid in turn:
                rounds[name].append(await round_of(base, clients, n, wpid, fpid))
        t, f = rounds["temper"], rounds["fusion16"]
        out["run_code_rps_c16"] = round(med(t, "rps"), 1)
        out["run_code_ms_c16"] = round(med(t, "ms"), 2)
        for c in PLATEAU_CLIENTS:
            out[f"sandboxfusion_rps_c{c}"] = round(med(rounds[f"fusion{c}"], "rps"), 1)
        out["sandboxfusion_ms_c16"] = round(med(f, "ms"), 2)
        plateau = max(float(out[f"sandboxfusion_rps_c{c}"]) for c in PLATEAU_CLIENTS)
        out["sandboxfusion_plateau_rps"] = plateau
        out["temper_over_sandboxfusion_plateau"] = round(float(out["run_code_rps_c16"]) / plateau, 3)
        out["target_5x_rps"] = round(5 * plateau, 1)
        for key in ("machine_ms", "user_ms", "system_ms", "client_ms", "worker_ms", "sandboxes_ms"):
            out[f"temper_{key}_per_request"] = round(med(t, key), 3)
        known = sum(float(out[f"temper_{k}_per_request"]) for k in ("client_ms", "worker_ms", "sandboxes_ms"))
        out["temper_other_ms_per_request"] = round(float(out["temper_machine_ms_per_request"]) - known, 3)
        out["temper_machine_ms_at_5x"] = round(
            2 * 1000 / (5 * plateau), 3
        )  # 2 cores' worth at 5x the plateau
        for key in ("machine_ms", "client_ms"):
            out[f"sandboxfusion_{key}_per_request"] = round(med(f, key), 3)
        if fusion_pid:
            out["sandboxfusion_server_ms_per_request"] = round(med(f, "server_ms"), 3)
        out["rounds"] = ROUNDS
        out["temper_requests_per_round"] = requests
        out["sandboxfusion_requests_per_round"] = fusion_requests
        out["failed"] = sum(r["failed"] for rs in rounds.values() for r in rs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    out["sandboxfusion_url"] = fusion
    out["cpus"] = os.cpu_count() or 0
    out["load_average_1m_start"] = round(load0, 2)
    out["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return out


def table(res: dict[str, float | int | str]) -> list[tuple[str, str, str]]:
    rows = [
        ("SandboxFusion, hello world, 4 / 16 / 64 clients (req/s)",
         f"{res['sandboxfusion_rps_c4']} / {res['sandboxfusion_rps_c16']} / {res['sandboxfusion_rps_c64']}",
         f"plateau {res['sandboxfusion_plateau_rps']}"),
        ("Temper run_code_rps_c16 (req/s)", f"{res['run_code_rps_c16']}", f"p50 {res['run_code_ms_c16']} ms"),
        ("Temper / SandboxFusion's plateau", f"{res['temper_over_sandboxfusion_plateau']}",
         f"target >= 3, aiming at 5 ({res['target_5x_rps']} req/s)"),
        ("whole machine CPU per request, Temper (ms)", f"{res['temper_machine_ms_per_request']}",
         f"user {res['temper_user_ms_per_request']}, system {res['temper_system_ms_per_request']}; "
         f"5x needs <= {res['temper_machine_ms_at_5x']}"),
        ("  the sandboxes (zygote runs)", f"{res['temper_sandboxes_ms_per_request']}", "forks, namespaces, mounts, program"),
        ("  the worker process", f"{res['temper_worker_ms_per_request']}", "HTTP, bookkeeping, cgroup reads"),
        ("  the load generator", f"{res['temper_client_ms_per_request']}", "same cores"),
        ("  the rest", f"{res['temper_other_ms_per_request']}", "spawner, kernel threads, other processes"),
        ("whole machine CPU per request, SandboxFusion (ms)", f"{res['sandboxfusion_machine_ms_per_request']}",
         f"server {res.get('sandboxfusion_server_ms_per_request', '-')}"),
    ]  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxfusion", default=os.environ.get("SANDBOXFUSION_URL"),
                        help="a running SandboxFusion (or SANDBOXFUSION_URL)")  # fmt: skip
    parser.add_argument("--sandboxfusion-pid", type=int, help="its server's process id, to count its CPU")
    parser.add_argument("--requests", type=int, default=400, help="Temper's requests per round")
    parser.add_argument(
        "--how", default="", help="how the SandboxFusion measured was built and run (kept in the results)"
    )
    args = parser.parse_args()
    if not args.sandboxfusion:
        raise SystemExit(
            "give a running SandboxFusion: --sandboxfusion URL or SANDBOXFUSION_URL (../shared/FACTS.md: "
            "bytedance/SandboxFusion 469de08 in a Python 3.11 venv from its poetry.lock, isolation none)"
        )
    res = asyncio.run(measure(args.sandboxfusion.rstrip("/"), args.sandboxfusion_pid, args.requests))
    res["sandboxfusion_how"] = args.how
    rows = table(res)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>17}  {note}")
    print(
        f"failed requests: {res['failed']}; load average {res['load_average_1m_start']} -> {res['load_average_1m_end']}"
    )
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
