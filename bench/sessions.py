"""Memory a live sandbox session costs: the sandbox worker's share of a live episode.

An episode of a multi-turn job holds a sandbox session from its first action to its
reward (the workspace it edits), also while it waits for the policy. This opens
``--sessions`` real sessions in one :class:`SandboxManager` (bubblewrap, cgroups, the
fork server, the product's default limits), runs one no-op command in each (``true``: a
session that has acted once and now waits), and reports:

- the machine's memory per session: the drop of ``MemAvailable`` (every process, the
  kernel's page tables and the workspaces' tmpfs pages), divided by the sessions;
- the sandboxes' own processes per session (proportional set size, so shared
  libraries are counted once) and how many processes a session keeps;
- the worker process's resident growth per session (its bookkeeping);
- how long opening a session took (median and p99).

    python bench/sessions.py                  # make bench-sessions: 200 sessions
    python bench/sessions.py --sessions 50    # a quicker look

Writes bench/results/sessions.json (flat JSON). docs/capacity.md uses the figures for
the workers a fleet of live episodes needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from bench.dispatch import pct  # noqa: E402
from bench.scale import rss_mb  # noqa: E402
from temper.sandbox import Action, SandboxManager, SandboxSettings  # noqa: E402


def mem_available_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (the worker's children: fork server, sandboxes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pss_kb(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except OSError:  # gone, or not ours to read
            pass
    return total


async def measure(n: int) -> dict:
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix="temper-bench-sessions-", ignore_cleanup_errors=True) as root:
        os.chmod(root, 0o755)  # the sandbox's uid reaches its workspace through it
        # no warm pool and no zygotes: every process the figures count belongs to a session
        settings = SandboxSettings(pool_size=0, zygotes=0, max_sessions=n, workspace_root=Path(root))
        manager = SandboxManager(settings)
        await manager.start()
        try:
            await asyncio.sleep(1)  # the fork server settles
            base_avail, base_rss_mb = mem_available_kb(), rss_mb(me)
            base_pids = set(descendants(me))
            base_pss = pss_kb(list(base_pids))
            sessions: list[str] = []
            open_ms: list[float] = []
            for _ in range(n):
                t0 = time.perf_counter()
                sid = await manager.create_session()
                open_ms.append((time.perf_counter() - t0) * 1000)
                result = await manager.act(sid, Action(kind="run_command", command="true"))
                if result.exit_code != 0:
                    raise SystemExit(f"a no-op command failed in session {sid}: {result}")
                sessions.append(sid)
            await asyncio.sleep(1)
            pids = [p for p in descendants(me) if p not in base_pids]
            figures = {
                "sessions": n,
                "machine_kb_per_session": round((base_avail - mem_available_kb()) / n, 1),
                "sandbox_pss_kb_per_session": round(
                    (pss_kb(pids) + pss_kb(list(base_pids)) - base_pss) / n, 1
                ),
                "processes_per_session": round(len(pids) / n, 2),
                "worker_rss_kb_per_session": round((rss_mb(me) - base_rss_mb) * 1024 / n, 1),
                "open_ms": round(statistics.median(open_ms), 1),
                "open_ms_p99": round(pct(open_ms, 0.99), 1),
                "cgroups": manager.get(sessions[0]).cgroup is not None,
                "workspace_mb_limit": settings.default_limits.workspace_mb,
                "memory_mb_limit": settings.default_limits.memory_mb,
            }
            for sid in sessions:
                await manager.destroy_session(sid)
        finally:
            await manager.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sessions.json"))
    args = parser.parse_args()
    figures = asyncio.run(measure(args.sessions))
    figures["cpus"] = os.cpu_count()
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")  # noqa: T201
    Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
