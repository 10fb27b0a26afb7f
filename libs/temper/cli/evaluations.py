"""``temper`` commands for evaluations (docs/job-spec.md, "evaluation"):

    temper eval JOB --version V [--taskset TS] [--split S] [--samples N] [--pass-at 1,4] [--wait]
    temper eval JOB --model DIR ...        a model directory, with the job's environment and rewards
    temper evals JOB [--tasks] [--json]    a job's evaluations: pass@k per version (per task with --tasks)

and the lines ``temper metrics``, ``temper watch`` and ``temper compare`` show of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from temper.cli.common import client, out
from temper.lifecycle import JOB_TERMINAL

ENDED = {s.value for s in JOB_TERMINAL}


def _num(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        for row in [header, *rows]
    ]


def ks_of(points: list[dict[str, Any]]) -> list[str]:
    """Every k the evaluations report, in order."""
    return sorted({k for p in points for k in (p.get("pass_at") or {})}, key=int)


def evaluation_rows(points: list[dict[str, Any]]) -> list[str]:
    """One row per evaluation: version (or model), label, state, pass@k for each k, mean reward."""
    ks = ks_of(points)
    rows = []
    for p in points:
        what = f"v{p['version']}" if p["version"] is not None else (p.get("model") or "?")
        rows.append(
            [what, p["label"], p["state"], f"{p['taskset']}:{p['split']}", str((p.get("summary") or {}).get("episodes", "–")),
             *(_num(p["pass_at"].get(k)) for k in ks), _num(p.get("reward_mean")), p["evaluation_job_id"]]
        )  # fmt: skip
    return _table(
        ["version", "label", "state", "tasks", "scored", *(f"pass@{k}" for k in ks), "reward", "job"], rows
    )


def task_rows(point: dict[str, Any]) -> list[str]:
    tasks = point.get("tasks") or []
    ks = sorted({k for t in tasks for k in t["pass_at"]}, key=int)
    rows = [
        [t["task_id"], str(t["samples"]), str(t["passed"]), *(_num(t["pass_at"].get(k)) for k in ks),
         _num(t["reward_mean"])]
        for t in tasks
    ]  # fmt: skip
    return _table(["task", "samples", "passed", *(f"pass@{k}" for k in ks), "reward"], rows)


def metrics_lines(m: dict[str, Any]) -> list[str]:
    """``temper metrics``' evaluation section."""
    points = m.get("evaluations") or []
    if not points:
        return []
    return ["\nevaluation per version (pass@k: the mean over tasks of the unbiased estimator)"] + [
        "  " + line for line in evaluation_rows(points)
    ]


def latest_line(m: dict[str, Any]) -> str | None:
    """The newest finished evaluation in one line, for the watch display."""
    done = [p for p in m.get("evaluations") or [] if p["state"] == "completed" and p["pass_at"]]
    if not done:
        running = [p for p in m.get("evaluations") or [] if p["state"] not in ENDED]
        return f"  eval: {len(running)} running" if running else None
    p = max(done, key=lambda q: (q["version"] is not None, q["version"] or 0))
    scores = " · ".join(
        f"pass@{k} {_num(v)}" for k, v in sorted(p["pass_at"].items(), key=lambda kv: int(kv[0]))
    )
    return f"  eval v{p['version']} ({p['label']}, {p['split']}): {scores}   reward {_num(p['reward_mean'])}"


def compare_lines(jobs: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[str]:
    """``temper compare``'s evaluation section: pass@k per version side by side (each job's
    first label; the k they share)."""
    series = []
    for m in metrics:
        points = [
            p for p in m.get("evaluations") or [] if p["version"] is not None and p["state"] == "completed"
        ]
        labels = sorted({p["label"] for p in points})
        series.append([p for p in points if labels and p["label"] == labels[0]])
    if not any(series):
        return []
    common = set.intersection(*(set(ks_of(s)) for s in series if s)) or {"1"}
    k = min(common, key=int)
    versions = sorted({p["version"] for s in series for p in s})
    by_job = [{p["version"]: p["pass_at"].get(k) for p in s} for s in series]
    rows = [[f"v{v}", *(_num(c.get(v)) for c in by_job)] for v in versions]
    return ["", f"eval pass@{k} per version"] + [
        "  " + line for line in _table(["version", *(j["id"] for j in jobs)], rows)
    ]


def cmd_eval(args: argparse.Namespace) -> int:
    if (args.version is None) == (args.model is None):
        sys.stderr.write("temper eval: give --version V or --model DIR\n")
        return 2
    sampling = None
    if args.temperature is not None or args.max_tokens is not None:
        with client(args) as api:
            base = (api.job(args.job)["spec"]["policy"] or {}).get("sampling") or {}
        sampling = {**base, **{k: v for k, v in (("temperature", args.temperature),
                                                 ("max_tokens", args.max_tokens)) if v is not None}}  # fmt: skip
    body: dict[str, Any] = {
        "version": args.version, "model": args.model, "taskset": args.taskset, "split": args.split,
        "samples": args.samples, "pass_at": [int(k) for k in args.pass_at.split(",")] if args.pass_at else None,
        "passed_by": args.passed_by, "pass_threshold": args.pass_threshold, "label": args.label,
        "sampling": sampling, "max_concurrent_episodes": args.max_concurrent,
    }  # fmt: skip
    with client(args) as api:
        made = api.evaluate(args.job, **body)
        out(made["evaluation_job_id"])
        what = f"v{made['version']}" if made["version"] is not None else made["model"]
        sys.stderr.write(
            f"evaluating {what} of {made['source_job_id']} on {made['taskset']} ({made['split']}), "
            f"{made['samples']} samples a task, as job {made['evaluation_job_id']}\n"
        )
        if not args.wait:
            return 0
        job_id = made["evaluation_job_id"]
        deadline = time.monotonic() + args.timeout
        while True:
            (point,) = api.evaluations(job_id, tasks=True)
            if point["state"] in ENDED:
                break
            if time.monotonic() > deadline:
                sys.stderr.write(f"temper eval: {job_id} still {point['state']} after {args.timeout:.0f}s\n")
                return 1
            time.sleep(args.interval)
    for line in evaluation_rows([point]):
        out(line)
    out("")
    for line in task_rows(point):
        out(line)
    return 0 if point["state"] == "completed" else 1


def cmd_evals(args: argparse.Namespace) -> int:
    with client(args) as api:
        points = api.evaluations(args.job, tasks=args.tasks)
    if args.json:
        out(json.dumps(points, indent=2))
        return 0
    if not points:
        out("no evaluation of this job yet")
        return 0
    for line in evaluation_rows(points):
        out(line)
    if args.tasks:
        for p in points:
            what = f"v{p['version']}" if p["version"] is not None else p["model"]
            out(f"\n{what} ({p['label']}, {p['taskset']}:{p['split']}), per task")
            for line in task_rows(p):
                out("  " + line)
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a version of a job (or a model directory) as a job of its own; prints its id"
    )
    p.add_argument("job", help="the job: its versions, or its environment and rewards for --model")
    p.add_argument("--version", type=int, help="a version the job published (0: its initial weights)")
    p.add_argument("--model", help="a model directory to evaluate instead")
    p.add_argument("--taskset", help="a task set of yours (default: the job's)")
    p.add_argument("--split", choices=("held_out", "train", "all"),
                   help="default: held_out of the job's task set, all of another")  # fmt: skip
    p.add_argument("--samples", type=int, default=1, help="episodes per task (default 1)")
    p.add_argument("--pass-at", help="the k of pass@k, comma-separated, each <= --samples (default 1)")
    p.add_argument(
        "--passed-by", default="default", help="default, reward, or one of the job's reward components"
    )
    p.add_argument(
        "--pass-threshold", type=float, help="with --passed-by reward or a component (default 1.0)"
    )
    p.add_argument("--temperature", type=float, help="default: the job's policy.sampling")
    p.add_argument("--max-tokens", type=int, help="default: the job's policy.sampling")
    p.add_argument("--max-concurrent", type=int, help="episodes in flight (default: the job's)")
    p.add_argument("--label", default="eval", help="the name its results are logged under")
    p.add_argument("--wait", action="store_true", help="wait for it to end and print its results per task")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("evals", help="a job's evaluations: pass@k per version")
    p.add_argument("job")
    p.add_argument("--tasks", action="store_true", help="each evaluation's results per task")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evals)
