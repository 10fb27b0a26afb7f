"""What each per-run isolation piece of issue 27 costs a one-shot run on a zygote.

One manager per variant, each with one zygote (``SandboxManager.run_fresh``, in this
process): every piece on (the default), each piece switched off alone by the
benchmark-only ``bench_pieces_off``, and all of them off. Rounds alternate the variants so
machine noise hits all alike, and a piece's cost is the median over rounds of its
difference in the same round. Per run: the CPU of the zygote's cgroup (its agent, the
run's init and the program, and the kernel's work in them: mounts, namespaces, the filter)
plus this process's (the worker's side), and the wall time. The zygote's start, which
``zygote_max_runs`` spreads over that many runs, is measured too.

    python bench/sandbox_pieces.py       # prints the table; bench/sandbox.py merges the figures
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from temper.sandbox import Action, SandboxManager, SandboxSettings  # noqa: E402
from temper.settings.sandbox import IsolationPiece  # noqa: E402

HELLO = Action(kind="run_python", code="print('hello')")
FETCH = Action(kind="run_python", code="open('out.txt', 'w').write('x' * 4096)")


def variants() -> dict[str, list[IsolationPiece]]:
    return {"on": [], **{p.value: [p] for p in IsolationPiece}, "off": list(IsolationPiece)}


async def _cpu_ns(manager: SandboxManager) -> int:
    (zygote,) = manager.zygotes._idle
    assert zygote.cgroup is not None
    return zygote.cgroup.stats().cpu_ns


async def _batch(
    manager: SandboxManager, runs: int, action: Action, fetch: list[str]
) -> tuple[float, list[float]]:
    """CPU ms per run (zygote cgroup + this process) and each run's wall ms."""
    cpu0, own0 = await _cpu_ns(manager), time.process_time()
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r, fetched = await manager.run_fresh(None, {}, action, fetch)
        walls.append((time.perf_counter() - t0) * 1000)
        assert r.ok and (not fetch or fetched == {"out.txt": b"x" * 4096}), r
    cpu = (await _cpu_ns(manager) - cpu0) / 1e6 + (time.process_time() - own0) * 1000
    return cpu / runs, walls


async def measure(runs: int = 150, rounds: int = 6) -> dict[str, float | int]:
    root = Path("/tmp") / f"temper-bench-pieces-{uuid.uuid4().hex[:8]}"
    managers: dict[str, SandboxManager] = {}
    out: dict[str, float | int] = {}
    try:
        for name, off in variants().items():
            settings = SandboxSettings(
                pool_size=0, zygotes=1, workspace_root=root / name, bench_pieces_off=off,
                zygote_max_runs=10 * runs * rounds,  # no recycle inside the batches
            )  # fmt: skip
            m = managers[name] = SandboxManager(settings)
            await m.start()
            own0 = time.process_time()
            await m.run_fresh(None, {}, HELLO)  # starts the zygote (bwrap, agent, probe run)
            if name == "on":
                (zygote,) = m.zygotes._idle
                assert zygote.cgroup is not None
                start_ms = zygote.cgroup.stats().cpu_ns / 1e6 + (time.process_time() - own0) * 1000
            await _batch(m, 20, HELLO, [])  # warm
        cpu: dict[str, list[float]] = {name: [] for name in managers}
        wall: dict[str, list[float]] = {name: [] for name in managers}
        fetch_cpu: dict[str, list[float]] = {"on": [], "fetch": []}
        for i in range(rounds):
            order = list(managers) if i % 2 == 0 else list(managers)[::-1]
            for name in order:
                per_run, walls = await _batch(managers[name], runs, HELLO, [])
                cpu[name].append(per_run)
                wall[name] += walls
                if name in fetch_cpu:  # the fetch path itself: one file written and read back
                    fetch_cpu[name].append((await _batch(managers[name], runs // 3, FETCH, ["out.txt"]))[0])

        def cost(off: str, table: dict[str, list[float]] = cpu) -> float:
            """The median over rounds of (every piece on) - (``off``) in the same round:
            drift between rounds cancels out."""
            return round(statistics.median(a - b for a, b in zip(table["on"], table[off], strict=True)), 3)

        on = statistics.median(cpu["on"])
        for name in managers:
            out[f"zygote_run_cpu_ms_{name}"] = round(statistics.median(cpu[name]), 3)
            out[f"zygote_run_ms_{name}"] = round(statistics.median(wall[name]), 3)
        for piece in IsolationPiece:
            out[f"piece_cost_cpu_ms_{piece.value}"] = cost(piece.value)
        out["piece_cost_cpu_ms_all"] = cost("off")
        out["piece_cost_cpu_ms_fetch_one_file"] = cost("fetch", fetch_cpu)
        max_runs = SandboxSettings().zygote_max_runs
        out["zygote_start_cpu_ms"] = round(start_ms - on, 2)
        out["piece_cost_cpu_ms_recycle_runs"] = round((start_ms - on) / max_runs, 3)
        out["piece_runs"] = runs * rounds
    finally:
        for m in managers.values():
            await m.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def table(res: dict[str, float | int]) -> list[tuple[str, str, str]]:
    rows = [
        ("zygote run CPU, every piece on (ms)", f"{res['zygote_run_cpu_ms_on']}", f"wall p50 {res['zygote_run_ms_on']} ms"),
        ("zygote run CPU, every piece off (ms)", f"{res['zygote_run_cpu_ms_off']}", f"wall p50 {res['zygote_run_ms_off']} ms"),
    ]  # fmt: skip
    notes = {
        "dev": "read-only /dev, per-run /dev/shm + /dev/pts",
        "seccomp": "the filter on every system call",
        "fetch": "kill + reap before the report",
        "recycle": "memory.stat after each run",
        "all": "the four together",
        "fetch_one_file": "openat2 + kill, one 4 KB file fetched",
        "recycle_runs": f"a zygote start ({res['zygote_start_cpu_ms']} ms) over zygote_max_runs",
    }
    for key, note in notes.items():
        rows.append((f"  cost of {key} per run (CPU ms)", f"{res[f'piece_cost_cpu_ms_{key}']}", note))
    return rows


def main() -> None:
    res = asyncio.run(measure())
    rows = table(res)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")


if __name__ == "__main__":
    main()
