"""Chaos on the real stack: break each part while it holds work, and check what was trained.

Every service runs as its own process (tests/faults/harness.py's FaultStack) against a
private Postgres, a private MinIO behind a TCP proxy and a private Kafka broker, so the
shared stack is never touched. The workload (tests/faults/workload.py, chaos.py): groups
of three jobs at once on one base model, two LoRA jobs and a full-weight job, on two CPU
engines, whose multi-turn episodes run an action in a sandbox session on every turn and
are scored by hidden tests in fresh sandboxes. The scenarios:

- SIGKILL a service while it holds work at a fault point (``temper.faults``), then start it
  again: a sandbox worker after an agent's action (sessions live, a turn behind them), the
  reward scorer with a score not recorded, the gateway with a generation not tagged and with
  a version about to be loaded, the trainer after an optimizer step and mid-publish (files
  up, no row), the dispatcher with a batch of results in an open transaction;
- stop the Kafka broker (SIGKILL), Postgres (fast shutdown) and the object store (SIGKILL)
  mid-iteration, leave each down a few seconds, start it again;
- make the object store answer every request with 503 for 20 s from a publish on.

The scenarios of one service share a group, as do the four infrastructure faults. After
each group: every job completed, every episode was scored once and trained once, nothing
trained twice, no outbox row lost, and the content checks (tests/faults/content.py): every
version tag in the registry for its job, every model turn's logprobs recomputed under its
version's weights (``mislabelled_samples``), a sample of episodes scored again from the
scorer's stored submission (``rescore_disagreements``), every sandbox turn in the workspace
of the snapshot it continued from. A scenario passes if its group passed those checks, it
held work at the fault (``in_flight_at_kill``) and the group made correct progress after it
(``recovery_s``: from the fault to the first result with a registered version, sandbox turn
in its snapshot's workspace, score or published version, as chaos.py says per service).

    python bench/chaos.py                  # make chaos
    python bench/chaos.py --only trainer   # the scenarios whose name contains "trainer"

Writes bench/results/chaos.json (flat JSON, with the commit it ran on) and prints a table.
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

from temper.provenance import source  # noqa: E402
from tests.faults.chaos import KILLS, Chaos, JobCheck, JobFinished, Outcome, Recovery  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "chaos.json"
Plan = list[tuple[str, int, list[tuple[str, Callable[[], Recovery]]]]]


def plan(chaos: Chaos) -> Plan:
    """(group name, iterations, scenarios in order); the lambdas bind their arguments now."""
    groups: Plan = []
    for service, moments in KILLS.items():
        scenarios = [
            (f"kill {service} @ {moment}", lambda s=service, m=moment: chaos.kill_at(s, m))
            for moment in moments
        ]
        groups.append((service, 3 + len(scenarios), scenarios))
    groups.append(("infrastructure", 6, [
        ("restart kafka", chaos.restart_kafka),
        ("restart postgres", chaos.restart_postgres),
        ("restart object store", chaos.restart_object_store),
        ("object store refuses 20 s", chaos.refuse_object_store),
    ]))  # fmt: skip
    return groups


TOTALS = (
    "episodes_lost", "double_scored", "double_trained", "outbox_rows_lost", "mislabelled_samples",
    "rescore_disagreements", "workspace_mismatches", "samples_recomputed", "tags_checked", "rescored",
    "sandbox_turns_checked", "sessions_moved",
)  # fmt: skip


def finish(chaos: Chaos, mine: list[Outcome], totals: dict[str, int]) -> None:
    """Wait for the current group, check it, and mark its scenarios."""
    try:
        check = chaos.check_job()
        print(f"  {check.summary}")
    except Exception as exc:
        print(f"  group FAILED {type(exc).__name__}: {str(exc)[:2000]}")
        check = JobCheck(-1, -1, -1, -1, [str(exc)[:300]])
    for problem in check.problems:
        print(f"  {problem[:1000]}")
    for outcome in mine:
        outcome.job_ok = check.ok
        if not check.ok and outcome.error is None:
            outcome.error = "; ".join(check.problems)[:300] or "the group lost work or its content is wrong"
    c = check.content
    found = {
        "episodes_lost": check.episodes_lost, "double_scored": check.double_scored,
        "double_trained": check.double_trained, "outbox_rows_lost": check.outbox_lost,
        "mislabelled_samples": c.mislabelled_samples, "rescore_disagreements": c.rescore_disagreements,
        "workspace_mismatches": c.workspace_mismatches, "samples_recomputed": sum(c.samples_checked.values()),
        "tags_checked": c.tags_checked, "rescored": c.rescored, "sandbox_turns_checked": c.turns_checked,
        "sessions_moved": c.sessions_moved,
    }  # fmt: skip
    for name, value in found.items():
        totals[name] += abs(value)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="temper-chaos-"))
    chaos = Chaos(workdir, args.step_timeout)
    outcomes: list[Outcome] = []
    totals = dict.fromkeys(TOTALS, 0)
    try:
        for name, iterations, scenarios in plan(chaos):
            wanted = [w for w in args.only.split(",") if w]
            scenarios = [(n, f) for n, f in scenarios if not wanted or any(w in n for w in wanted)]
            if not scenarios:
                continue
            print(f"group {name}: 3 jobs of {iterations} iterations, {len(scenarios)} faults")
            chaos.submit(name, iterations)
            mine: list[Outcome] = []
            for scenario, fault in scenarios:
                outcome = Outcome(scenario)
                for attempt in range(2):
                    try:
                        outcome.took(fault())
                        print(
                            f"  {scenario}: {outcome.in_flight} in flight, recovered in {outcome.recovery_s:.1f}s"
                        )
                    except JobFinished as exc:
                        if attempt == 0:  # too quick a group: check it, go on in a new one
                            print(f"  {exc}: next group")
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
    code = source()
    result: dict[str, Any] = {
        "commit": code["commit"],
        "dirty": code["dirty"],
        "scenarios": len(outcomes),
        "scenarios_passed": sum(o.passed for o in outcomes),
        **totals,
        "max_recovery_s": max(recoveries, default=None),
        "groups": chaos.groups,
        "jobs": len(chaos.all_jobs),
    }
    for o in outcomes:  # flat, like every bench result: one scalar per figure
        result[f"recovery_s[{o.scenario}]"] = o.recovery_s
        result[f"in_flight_at_kill[{o.scenario}]"] = o.in_flight
        result[f"passed[{o.scenario}]"] = o.passed
        if o.error:
            result[f"error[{o.scenario}]"] = o.error
    print(table(outcomes))
    return result


def table(outcomes: list[Outcome]) -> str:
    width = max((len(o.scenario) for o in outcomes), default=10)
    lines = [
        f"{'scenario':<{width}}  result  in_flight_at_kill  recovery_s",
        f"{'-' * width}  ------  -----------------  ----------",
    ]
    for o in outcomes:
        rec = "-" if o.recovery_s is None else f"{o.recovery_s:.1f}"
        held = "-" if o.in_flight is None else str(o.in_flight)
        lines.append(f"{o.scenario:<{width}}  {'pass' if o.passed else 'FAIL':<6}  {held:>17}  {rec:>10}")
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
    ok = result["scenarios_passed"] == result["scenarios"] and not (
        result["mislabelled_samples"] or result["rescore_disagreements"] or result["workspace_mismatches"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    # The private broker's restarts make aiokafka log each failed retry; the table says enough.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    sys.exit(main())
