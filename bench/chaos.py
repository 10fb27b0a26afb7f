"""Chaos on the real stack: break each part of a running job and check that nothing is lost.

Every service runs as its own process (tests/faults/harness.py's FaultStack) against a
private Postgres, a private MinIO behind a TCP proxy and a private Kafka broker, so the
shared stack is never touched. The scenarios, in turn:

- SIGKILL each of the five services, then start it again, at three moments of a job:
  ``early`` (the first inference results are in, no version yet), ``mid-iteration`` (a
  version is out and episodes are in flight) and ``publish`` (the trainer is uploading a
  version: the proxy sees the PUT and the kill happens before the upload goes on);
- stop the Kafka broker (SIGKILL), Postgres (fast shutdown) and the object store
  (SIGKILL) mid-job, leave each down a few seconds, start it again;
- make the object store answer every request with 503 for 20 s.

The three moments of one service share a job, as do the four infrastructure faults.
After each job: it completed, every episode was scored exactly once and trained once, no
trajectory was trained twice, and no outbox row was lost (every row is on its topic).
A scenario passes if the job recovered from it (see ``recovery_s``) and its job passed
those checks. ``recovery_s``: from the fault until the job made progress again once the
broken part was back (a step finished, a trajectory reached the trainer or a version was
published; for a killed trainer, a trajectory or a version).

    python bench/chaos.py                  # make chaos
    python bench/chaos.py --only trainer   # the scenarios whose name contains "trainer"

Writes bench/results/chaos.json (flat JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from tests.faults.chaos import MOMENTS, Chaos, JobCheck, JobFinished, Outcome  # noqa: E402
from tests.faults.harness import FaultStack  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "chaos.json"


def plan(chaos: Chaos) -> list[tuple[str, int, list[tuple[str, Callable[[], float]]]]]:
    """(job name, iterations, scenarios in order); the lambdas bind their arguments now."""
    jobs: list[tuple[str, int, list[tuple[str, Callable[[], float]]]]] = []
    for service in FaultStack.SERVICE_NAMES:
        scenarios = [
            (f"kill {service} @ {moment}", lambda s=service, m=moment: chaos.kill_and_restart(s, m))
            for moment in MOMENTS
        ]
        jobs.append((service, 6, scenarios))
    jobs.append(("infrastructure", 8, [
        ("restart kafka", chaos.restart_kafka),
        ("restart postgres", chaos.restart_postgres),
        ("restart object store", chaos.restart_object_store),
        ("object store refuses 20 s", chaos.refuse_object_store),
    ]))  # fmt: skip
    return jobs


def finish(chaos: Chaos, mine: list[Outcome], totals: dict[str, int]) -> None:
    """Wait for the current job, check it, and mark its scenarios."""
    try:
        check = chaos.check_job()
        print(f"  {check.summary}")
    except Exception as exc:
        print(f"  job FAILED {type(exc).__name__}: {str(exc)[:2000]}")
        check = JobCheck(-1, -1, -1, -1, [str(exc)[:300]])
    for problem in check.problems:
        print(f"  {problem[:1000]}")
    for outcome in mine:
        outcome.job_ok = check.ok
        if not check.ok and outcome.error is None:
            outcome.error = "; ".join(check.problems)[:300] or "job lost work"
    totals["episodes_lost"] += abs(check.episodes_lost)
    totals["double_scored"] += abs(check.double_scored)
    totals["double_trained"] += abs(check.double_trained)
    totals["outbox_rows_lost"] += abs(check.outbox_lost)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="temper-chaos-"))
    chaos = Chaos(workdir, args.step_timeout)
    outcomes: list[Outcome] = []
    totals = {"episodes_lost": 0, "double_scored": 0, "double_trained": 0, "outbox_rows_lost": 0}
    try:
        for name, iterations, scenarios in plan(chaos):
            wanted = [w for w in args.only.split(",") if w]
            scenarios = [(n, f) for n, f in scenarios if not wanted or any(w in n for w in wanted)]
            if not scenarios:
                continue
            print(f"job {name}: {iterations} iterations, {len(scenarios)} faults")
            chaos.submit(name, iterations)
            mine: list[Outcome] = []
            for scenario, fault in scenarios:
                outcome = Outcome(scenario)
                for attempt in range(2):
                    try:
                        outcome.recovery_s = round(fault(), 2)
                        print(f"  {scenario}: recovered in {outcome.recovery_s:.1f}s")
                    except JobFinished as exc:
                        if attempt == 0:  # too quick a job: check it, go on in a new one
                            print(f"  {exc}: next job")
                            finish(chaos, mine, totals)
                            outcomes += mine
                            mine = []
                            chaos.submit(name, iterations)
                            continue
                        outcome.error = f"{type(exc).__name__}: {exc}"
                    except Exception as exc:  # a failed scenario is a result; the next still runs
                        outcome.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                        print(f"  {scenario}: FAILED {outcome.error}")
                        traceback.print_exc(limit=3)
                    break
                mine.append(outcome)
            finish(chaos, mine, totals)
            outcomes += mine
    finally:
        chaos.close()
    recoveries = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    result: dict[str, Any] = {
        "scenarios": len(outcomes),
        "scenarios_passed": sum(o.passed for o in outcomes),
        **totals,
        "max_recovery_s": max(recoveries, default=None),
        "jobs": chaos.jobs,
    }
    for o in outcomes:  # flat, like every bench result: one scalar per figure
        result[f"recovery_s[{o.scenario}]"] = o.recovery_s
        result[f"passed[{o.scenario}]"] = o.passed
        if o.error:
            result[f"error[{o.scenario}]"] = o.error
    print(table(outcomes))
    return result


def table(outcomes: list[Outcome]) -> str:
    width = max((len(o.scenario) for o in outcomes), default=10)
    lines = [f"{'scenario':<{width}}  result  recovery_s", f"{'-' * width}  ------  ----------"]
    for o in outcomes:
        rec = "-" if o.recovery_s is None else f"{o.recovery_s:.1f}"
        lines.append(f"{o.scenario:<{width}}  {'pass' if o.passed else 'FAIL':<6}  {rec:>10}")
        if o.error:
            lines.append(f"{'':<{width}}    {o.error[:160]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", default="", help="run only the scenarios whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--step-timeout", type=float, default=240.0,
                        help="seconds to wait for one moment, restart or recovery")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = run(args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "[" not in k}))
    return 0 if result["scenarios_passed"] == result["scenarios"] else 1


if __name__ == "__main__":
    # The private broker's restarts make aiokafka log each failed retry; the table says enough.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    sys.exit(main())
