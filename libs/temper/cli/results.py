"""Getting results out, from the command line (over the REST API):

    temper episodes JOB [--state S] [--task T] [--all] [--json]   a job's episodes
    temper metrics JOB [--json]                                    progress, reward per iteration, pass rates
    temper logs EPISODE                                            an episode's stored log (JSON lines)
    temper export JOB [--format jsonl|parquet] [-o FILE]           trajectories: tokens, logprobs, rewards, versions
    temper export JOB --evaluations [-o FILE]                      its evaluations: pass@k per version and task
    temper checkpoints JOB [--download V [-o FILE]]                policy versions, and their weights
    temper compare JOB JOB [...]                                   reward curves and eval pass@k side by side

Iterations and turns are counted from 1, as the console counts them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from temper.cli import evaluations
from temper.cli.common import client, out
from temper.cli.jobs import progress_lines
from temper.client import ApiError
from temper.lifecycle import JOB_TERMINAL, EpisodeState


def _reward(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        for row in [header, *rows]
    ]


def turns_taken(episode: dict[str, Any]) -> int:
    return 0 if episode["state"] == "pending" else int(episode["turn"]) + 1


def cmd_episodes(args: argparse.Namespace) -> int:
    items: list[dict[str, Any]] = []
    with client(args) as api:
        cursor = None
        while True:
            page = api.episodes(
                args.job,
                state=args.state,
                task=args.task,
                iteration=None if args.iteration is None else args.iteration - 1,
                limit=min(args.limit, 500),
                cursor=cursor,
            )
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor or (not args.all and len(items) >= args.limit):
                break
        total = page["total"]
    if args.json:
        out(json.dumps(items, indent=2))
        return 0
    rows = [
        [e["id"], str(e["iteration"] + 1), e["task_id"], e["state"], str(turns_taken(e)), _reward(e["reward"]),
         "–" if e["behaviour_version"] is None else f"v{e['behaviour_version']}"]
        for e in items
    ]  # fmt: skip
    for line in table(["episode", "iteration", "task", "state", "turns", "reward", "policy"], rows):
        out(line)
    if len(items) < total:
        out(f"({len(items)} of {total}; --all for every one)")
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:

    with client(args) as api:
        job = api.job(args.job)
        m = api.metrics(args.job)
    if args.json:
        out(json.dumps(m, indent=2))
        return 0
    for line in progress_lines(job, m, color=False):
        out(line)
    if m["reward_curve"]:
        out("\nreward per iteration")
        rows = [
            [str(p["iteration"] + 1), str(p["episodes"]), f"{p['mean']:.3f}", f"{p['std']:.3f}",
             f"{p['min']:.3f}", f"{p['max']:.3f}"]
            for p in m["reward_curve"]
        ]  # fmt: skip
        for line in table(["iteration", "scored", "mean", "std", "min", "max"], rows):
            out("  " + line)
    for line in training_lines(m.get("training")):
        out(line)
    if m["pass_rates"]:
        out("\npass rate per task")
        rows = [
            [
                p["task_id"],
                str(p["episodes"]),
                str(p["passed"]),
                f"{p['pass_rate'] * 100:.1f}%",
                f"{p['mean_reward']:.3f}",
            ]
            for p in m["pass_rates"]
        ]
        for line in table(["task", "episodes", "passed", "pass rate", "mean reward"], rows):
            out("  " + line)
    for line in evaluations.metrics_lines(m):
        out(line)
    return 0


def training_lines(training: dict[str, Any] | None) -> list[str]:
    """The trainer's numbers per version, what it skipped, and why nothing trained yet."""
    if not training:
        return []
    lines: list[str] = []

    def f(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    if training["versions"]:
        lines.append("\ntraining per version")
        rows = [
            [f"v{v['version']}", str(v["step"]), f(v["loss"], ".4f"), f(v["kl"], ".4f"), f(v["entropy"], ".3f"),
             f(v["grad_norm"], ".3f"), f(v["clip_fraction"], ".3f"), f(v["learning_rate"], ".2e"),
             f(v["tokens"], "d"), f"{v['train_s']:.1f}"]
            for v in training["versions"]
        ]  # fmt: skip
        header = ["version", "step", "loss", "kl", "entropy", "grad norm", "clip", "lr", "tokens", "train s"]
        lines += ["  " + line for line in table(header, rows)]
    if training["skipped_groups"]:
        skipped = ", ".join(f"{r} {n}" for r, n in sorted(training["skipped_groups"].items()))
        lines.append(f"\ngroups not trained on: {skipped}")
    if training.get("not_trained_reason"):
        lines.append(f"\nnot trained yet: {training['not_trained_reason']}")
    return lines


def _last_ts(lines: bytes) -> str | None:
    last = lines.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return str(json.loads(last)["ts"]) if last else None


def cmd_logs(args: argparse.Namespace) -> int:
    """An episode's stored log; else (REF names no episode) the job's log lines, followed
    with ``--follow`` until the job ends."""
    with client(args) as api:
        if not args.job:
            try:
                data = api.episode_log(args.ref)
            except ApiError as exc:
                if exc.status != 404 or "has no log" in exc.detail:
                    raise
            else:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
                return 0
        data = api.job_log(args.ref, tail=args.tail)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        after = _last_ts(data)
        while args.follow:
            ended = api.job(args.ref)["state"] in JOB_TERMINAL  # then one last read
            if not ended:
                time.sleep(args.interval)
            data = api.job_log(args.ref, tail=5000, after=after)
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
            after = _last_ts(data) or after
            if ended:
                break
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.evaluations:  # the job's evaluations with their per-task results, one per line
        path = Path(args.output or f"{args.job}-evaluations.jsonl")
        with client(args) as api:
            found = api.evaluations(args.job, tasks=True)
        path.write_text("".join(json.dumps(e) + "\n" for e in found))
        sys.stderr.write(f"wrote {path} ({len(found)} evaluations)\n")
        return 0
    path = Path(args.output or f"{args.job}-trajectories.{args.format}")
    with client(args) as api:
        nxt = api.export(args.job, path, format=args.format, after=args.after, limit=args.limit)
    count = ""
    if args.format == "jsonl":
        with path.open("rb") as f:
            count = f"{sum(1 for _ in f)} trajectories, "
    sys.stderr.write(f"wrote {path} ({count}{path.stat().st_size} bytes)\n")
    if nxt:
        sys.stderr.write(f"more after this page: --after {nxt}\n")
    return 0


def _downloaded(dest: Path, got: dict[str, Any]) -> str:
    if got["kind"] == "lora":
        return f"wrote {dest}: a PEFT adapter directory for base model {got['base_model']}"
    if got["kind"] == "full":
        return f"wrote {dest}: a Hugging Face model directory ({len(got['files'])} files)"
    return f"wrote {dest} (the weights of a version published before the registry)"


def cmd_checkpoints(args: argparse.Namespace) -> int:
    with client(args) as api:
        if args.download is not None:
            dest = Path(args.output or f"{args.job}-v{args.download}")
            got = api.download_version(args.job, args.download, dest, with_base=args.with_base)
            sys.stderr.write(
                _downloaded(dest, got) + ("; its base in base/" if args.with_base else "") + "\n"
            )
            return 0
        if args.with_base:
            sys.stderr.write("error: --with-base goes with --download VERSION\n")
            return 2
        versions = api.checkpoints(args.job)
    if not versions:
        out("no policy version published yet")
        return 0
    rows = [[f"v{v['version']}", str(v["step"]), v["created_at"]] for v in versions]
    for line in table(["version", "step", "published"], rows):
        out(line)
    return 0


def cmd_export_model(args: argparse.Namespace) -> int:
    """A full version as it is; a LoRA version with its base beside it in ``base/``, or
    (``--merge``) merged into its base as one Hugging Face model directory."""
    import shutil
    import tempfile

    dest = Path(args.dir)
    if dest.exists() and any(dest.iterdir()):
        sys.stderr.write(f"error: {dest} exists and is not empty\n")
        return 2
    with client(args) as api, tempfile.TemporaryDirectory() as tmp:
        got = api.download_version(args.job, args.version, Path(tmp) / "version")
        if got["kind"] != "lora":
            if args.merge:
                sys.stderr.write(
                    f"error: version {args.version} holds full weights: there is no adapter to merge\n"
                )
                return 2
            shutil.copytree(Path(tmp) / "version", dest, dirs_exist_ok=True)
            sys.stderr.write(_downloaded(dest, got) + "\n")
            return 0
        if not args.merge:
            api.download_version(args.job, args.version, dest, with_base=True)
            sys.stderr.write(_downloaded(dest, got) + "; its base in base/\n")
            return 0
        api.download_version(args.job, args.version, Path(tmp) / "with-base", with_base=True)
        from temper.training.lora import merge_adapter

        merge_adapter(Path(tmp) / "with-base" / "base", Path(tmp) / "with-base", dest)
    sys.stderr.write(f"wrote {dest}: the adapter merged into its base {got['base_model']}\n")
    return 0


def compare_lines(jobs: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[str]:
    """A summary row per job, then the mean reward per iteration side by side."""
    rows = []
    for job, m in zip(jobs, metrics, strict=True):
        curve = m["reward_curve"]
        best = max((p["mean"] for p in curve), default=None)
        rows.append(
            [job["id"], job["name"], job["state"], str(len(curve)),
             _reward(curve[0]["mean"] if curve else None), _reward(curve[-1]["mean"] if curve else None),
             _reward(best), f"v{m['staleness']['current_version']}"]
        )  # fmt: skip
    lines = table(["job", "name", "state", "iterations", "first", "last", "best", "policy"], rows)
    iterations = sorted({p["iteration"] for m in metrics for p in m["reward_curve"]})
    if iterations:
        by_job = [{p["iteration"]: p["mean"] for p in m["reward_curve"]} for m in metrics]
        curve_rows = [[str(i + 1), *(_reward(c.get(i)) for c in by_job)] for i in iterations]
        lines += ["", "mean reward per iteration"]
        lines += ["  " + line for line in table(["iteration", *(j["id"] for j in jobs)], curve_rows)]
    return lines + evaluations.compare_lines(jobs, metrics)


def cmd_compare(args: argparse.Namespace) -> int:
    with client(args) as api:
        jobs = [api.job(j) for j in args.jobs]
        metrics = [api.metrics(j) for j in args.jobs]
    if args.json:
        out(json.dumps([{"job": j, "metrics": m} for j, m in zip(jobs, metrics, strict=True)], indent=2))
        return 0
    for line in compare_lines(jobs, metrics):
        out(line)
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("episodes", help="a job's episodes")
    p.add_argument("job")
    p.add_argument("--state", choices=[s.value for s in EpisodeState])
    p.add_argument("--task", help="only this task id")
    p.add_argument("--iteration", type=int, help="only this iteration (counted from 1)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--all", action="store_true", help="every episode, page after page")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_episodes)

    p = sub.add_parser("metrics", help="a job's progress, reward per iteration and pass rates")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("logs", help="an episode's stored log, or a job's log lines (JSON lines)")
    p.add_argument("ref", help="an episode id, or a job's id, handle or name")
    p.add_argument("--job", action="store_true", help="REF is a job (do not look for an episode)")
    p.add_argument("-n", "--tail", type=int, default=100, help="a job's last N lines")
    p.add_argument(
        "-f", "--follow", action="store_true", help="a job's new lines as they come, until it ends"
    )
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("export", help="a job's trajectories (tokens, logprobs, rewards, versions) to a file")
    p.add_argument("job")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument("-o", "--output", help="file to write (default JOB-trajectories.FORMAT)")
    p.add_argument("--after", help="start after this episode id (the next page)")
    p.add_argument("--limit", type=int, help="at most this many trajectories")
    p.add_argument(
        "--evaluations", action="store_true",
        help="the job's evaluations (pass@k per version, per task) as JSON lines instead",
    )  # fmt: skip
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "checkpoints", help="a job's policy versions; --download V writes one as a loadable directory"
    )
    p.add_argument("job")
    p.add_argument("--download", type=int, metavar="VERSION")
    p.add_argument("-o", "--output", help="directory to write (new or empty; default JOB-vVERSION)")
    p.add_argument("--with-base", action="store_true", help="a LoRA version: its base model too, in base/")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser(
        "export-model",
        help="a policy version as a model directory; --merge folds a LoRA adapter into its base",
    )
    p.add_argument("job")
    p.add_argument("version", type=int)
    p.add_argument("dir", help="directory to write (new or empty)")
    p.add_argument("--merge", action="store_true", help="a LoRA version: one merged model directory")
    p.set_defaults(func=cmd_export_model)

    p = sub.add_parser("compare", help="jobs side by side: summary and mean reward per iteration")
    p.add_argument("jobs", nargs="+", metavar="JOB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)
