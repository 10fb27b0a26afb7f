"""``temper`` commands for jobs:

    temper submit spec.yaml [--watch]      submit a job
    temper jobs [--state S] [--name N]     list jobs
    temper show JOB [--json]               a job: its state, spec digest and provenance
    temper rerun JOB [--handle H]          submit the job's resolved spec again (prints the new id)
    temper watch JOB                       live progress until the job ends
    temper transcript EPISODE [--json]     an episode's transcript
    temper pause|resume|cancel JOB
    temper admin create-tenant NAME        a tenant and its first API key (talks to the database)

The server and key come from ``--url``/``--key`` or ``TEMPER_URL``/``TEMPER_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from temper.cli.common import client, number, out
from temper.cli.evaluations import latest_line
from temper.client import TemperClient
from temper.lifecycle import JOB_TERMINAL, EpisodeState

E = EpisodeState
# the progress line's order: done first, then what is in flight, then the ends that are not done
STATE_ORDER = (E.trained, E.scored, E.scoring, E.acting, E.awaiting_action, E.pending, E.failed, E.cancelled)
GREEN, RED, YELLOW, DIM, BOLD, RESET = "\x1b[32m", "\x1b[31m", "\x1b[33m", "\x1b[2m", "\x1b[1m", "\x1b[0m"


# --- submit / jobs / control ------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    with client(args) as api:
        job = api.submit(Path(args.spec) if args.spec != "-" else sys.stdin.read())
        out(job["id"])
        sys.stderr.write(f"submitted {job['name']!r} as {job['id']} ({job['state']})\n")
        if args.watch:
            return watch(api, job["id"], interval=args.interval)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with client(args) as api:
        page = api.jobs(state=args.state, name=args.name, tag=args.tag, limit=args.limit)
    if args.json:
        out(json.dumps(page, indent=2))
        return 0
    rows = [("JOB", "HANDLE", "NAME", "STATE", "ITERATION", "POLICY", "CREATED", "TAGS")]
    for j in page["items"]:
        rows.append(
            (
                j["id"],
                j.get("handle") or "-",
                j["name"],
                j["state"],
                f"{shown_iteration(j)}/{j['iterations']}",
                f"v{j['policy_version']}",
                j["created_at"][:19].replace("T", " "),
                ",".join(j.get("tags") or []),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if page["total"] > len(page["items"]):
        out(f"({len(page['items'])} of {page['total']} shown; use --limit)")
    return 0


def provenance_lines(job: dict[str, Any]) -> list[str]:
    """What the job was made from (its ``provenance``), one fact a line."""
    p = job.get("provenance")
    if not p:
        return ["provenance: not recorded (the job was submitted before Temper recorded it)"]
    src, model, ts = p.get("temper") or {}, p.get("model") or {}, p.get("taskset") or {}
    commit = src.get("commit")
    if commit:
        commit_text = commit + (" (with uncommitted changes)" if src.get("dirty") else "")
    else:
        commit_text = f"unknown: {src.get('commit_unknown') or 'not recorded'}"
    seeds = ", ".join(f"{k}={v}" for k, v in sorted((p.get("seeds") or {}).items())) or "-"
    weights = model.get("init") or "-"
    model_digest = (
        model.get("sha256") or f"none ({model.get('note') or model.get('source') or 'not readable'})"
    )
    lines = [
        f"temper:        {src.get('version', '?')}, commit {commit_text}",
        f"seeds:         {seeds}",
        f"spec sha256:   {p.get('spec_sha256', '-')}",
        f"model:         {model.get('policy_model', '-')} (initial weights: {weights}, {model.get('source') or '-'})",
        f"model sha256:  {model_digest}" + (f" over {model['files']} files" if model.get("files") else ""),
        f"task set:      {ts.get('id', '-')} ({ts.get('name') or '-'}, {ts.get('tasks', 0)} tasks)",
        f"tasks sha256:  {ts.get('sha256', '-')}",
    ]
    if p.get("rerun_of"):
        lines.append(f"rerun of:      {p['rerun_of']}")
    return lines


def cmd_show(args: argparse.Namespace) -> int:
    with client(args) as api:
        job = api.job(args.job)
    if args.json:
        out(json.dumps(job, indent=2))
        return 0
    handle = f" ({job['handle']})" if job.get("handle") else ""
    out(f"{job['id']}{handle}  {job['name']}")
    out(f"state:         {job['state']}" + (f" ({job['state_reason']})" if job.get("state_reason") else ""))
    out(
        f"progress:      iteration {shown_iteration(job)}/{job['iterations']}, policy v{job['policy_version']}"
    )
    out(f"created:       {job['created_at'][:19].replace('T', ' ')}")
    if job.get("tags"):
        out(f"tags:          {','.join(job['tags'])}")
    for line in provenance_lines(job):
        out(line)
    return 0


def cmd_rerun(args: argparse.Namespace) -> int:
    with client(args) as api:
        job = api.rerun(args.job, handle=args.handle, name=args.name)
        out(job["id"])
        sys.stderr.write(f"submitted {args.job} again as {job['id']} ({job['state']})\n")
        if args.watch:
            return watch(api, job["id"], interval=args.interval)
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    change: dict[str, Any] = {}
    if args.set is not None:
        change["tags"] = args.set
    if args.note is not None:
        change["note"] = args.note or None
    if not change:
        sys.stderr.write("temper tag: give --set TAG... and/or --note TEXT\n")
        return 2
    with client(args) as api:
        job = api.update_job(args.job, **change)
    out(f"{job['id']} tags: {','.join(job['tags']) or '-'}; note: {job['note'] or '-'}")
    return 0


def _control(action: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with client(args) as api:
            job = getattr(api, action)(args.job)
        out(f"{job['id']} {job['state']}")
        return 0

    return run


# --- watch ------------------------------------------------------------------------------


def shown_iteration(progress: dict[str, Any]) -> int:
    """The job's iteration as people count it (from 1; a finished 8-iteration job is at 8)."""
    total = int(progress["iterations"])
    return min(int(progress["iteration"]) + 1, total) if total else int(progress["iteration"]) + 1


def progress_lines(job: dict[str, Any], m: dict[str, Any], *, color: bool, width: int = 80) -> list[str]:
    """The watch display: header, bar, episode states, reward/throughput/staleness."""

    def c(code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if color else text

    p = m["progress"]
    state = p["state"]
    state_txt = c(
        GREEN if state == "completed" else RED if state in ("failed", "cancelled") else YELLOW, state
    )
    header = (
        f"{c(BOLD, job['id'])} {job['name']}  {state_txt}  iteration {shown_iteration(p)}/{p['iterations']}  "
        f"policy v{m['staleness']['current_version']}"
    )
    bar_w = max(10, min(50, width - 30))
    algorithm = job.get("algorithm") or ((job.get("spec") or {}).get("algorithm") or {}).get("name")
    if algorithm in ("sft", "dpo", "reward_model"):  # no episodes: epochs, steps and the loss
        versions = m["training"]["versions"]
        latest = versions[-1] if versions else None
        fraction = 1.0 if state == "completed" else p["iteration"] / max(p["iterations"], 1)
        done = round(fraction * bar_w)
        loss = f"loss {latest['loss']:.4f}" if latest and latest["loss"] is not None else "no version yet"
        step = f"step {latest['step']}" if latest else "step 0"
        return [
            header,
            "["
            + c(GREEN, "█" * done)
            + "░" * (bar_w - done)
            + f"] {step}  ({algorithm}: epochs, no episodes)",
            f"  {loss} (the latest version's last step)",
        ]
    done = round(p["fraction"] * bar_w)
    bar = "[" + c(GREEN, "█" * done) + "░" * (bar_w - done) + "]"
    counts = p["episodes_by_state"]
    states = " · ".join(f"{s} {counts[s]}" for s in STATE_ORDER if counts.get(s)) or "no episodes yet"
    # the newest iteration with scored episodes (an iteration without any has no mean)
    scored = [point for point in m["reward_curve"] if point["episodes"]]
    if scored:
        last = scored[-1]
        reward = f"mean reward {last['mean']:.3f} ± {last['std']:.3f} (iteration {last['iteration'] + 1})"
        if last["iteration"] < p["iteration"] and state not in ("completed", "failed", "cancelled"):
            reward += f", iteration {p['iteration'] + 1}: nothing scored yet"
    else:
        reward = "mean reward – (nothing scored yet)"
    st = m["staleness"]
    stale = st["max"] if st["max"] is not None else (st["in_flight_max"] or 0)
    lines = [
        header,
        f"{bar} {p['fraction'] * 100:5.1f}%  {p['finished']}/{p['episodes_total']} episodes",
        "  " + states,
        f"  {reward}   {m['throughput']['episodes_per_min']:.1f} episodes/min   staleness {stale}/{st['max_staleness']}",
    ]
    evaluated = latest_line(m)
    return lines + ([evaluated] if evaluated else [])


def watch(
    api: TemperClient,
    job_id: str,
    *,
    interval: float = 2.0,
    stream: TextIO | None = None,
    max_polls: int | None = None,
) -> int:
    """Redraw the progress block in place until the job ends; 0 if it completed."""
    dest = stream or sys.stdout
    tty = dest.isatty() and os.environ.get("TERM") != "dumb"
    drawn = 0
    polls = 0
    last_plain = None
    while True:
        job = api.job(job_id)
        m = api.metrics(job_id)
        lines = progress_lines(job, m, color=tty, width=shutil.get_terminal_size((80, 20)).columns)
        if tty:
            if drawn:
                dest.write(f"\x1b[{drawn}A")
            dest.write("".join(f"\r\x1b[2K{line}\n" for line in lines))
            drawn = len(lines)
        elif lines != last_plain:
            dest.write("\n".join(lines) + "\n")
            last_plain = lines
        dest.flush()
        polls += 1
        if job["state"] in JOB_TERMINAL:
            return 0 if job["state"] == "completed" else 1
        if max_polls is not None and polls >= max_polls:
            return 0
        time.sleep(interval)


def cmd_watch(args: argparse.Namespace) -> int:
    with client(args) as api:
        try:
            return watch(api, args.job, interval=args.interval)
        except KeyboardInterrupt:
            return 130


# --- transcript -------------------------------------------------------------------------


def render_transcript(t: dict[str, Any], *, color: bool = False) -> str:
    def c(code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if color else text

    ep = t["episode"]
    reward = "–" if t["reward"] is None else f"{t['reward']:.3f}"
    lines = [
        c(BOLD, f"episode {ep['id']}")
        + f"  job {ep['job_id']}  task {ep['task_id']}  iteration {ep['iteration'] + 1}",
        f"state {ep['state']}"
        + (f" ({ep['state_reason']})" if ep.get("state_reason") else "")
        + f"  reward {reward}  policy versions {', '.join(f'v{v}' for v in t['policy_versions']) or '–'}",
        "",
    ]
    for turn in t["turns"]:
        version = f" policy v{turn['policy_version']}" if turn["policy_version"] is not None else ""
        timings = "  ".join(f"{k} {v:.3f}" for k, v in sorted(turn["timings"].items()))
        # turns counted from 1, as in the console
        lines.append(
            c(BOLD, f"── turn {turn['turn'] + 1}{version}") + (f"  {c(DIM, timings)}" if timings else "")
        )
        if turn["prompt"]:
            lines += [c(DIM, f"[prompt, {turn['prompt_tokens']} tokens]"), turn["prompt"].rstrip()]
        lines += [c(DIM, f"[action, {turn['action_tokens']} tokens]"), turn["action_text"].rstrip()]
        if turn["observation"] or turn["kill_reason"] or turn["exit_code"] is not None:
            tags = []
            if turn["exit_code"] is not None:
                tags.append(f"exit {turn['exit_code']}")
            if turn["kill_reason"]:
                tags.append(c(RED, f"killed: {turn['kill_reason']}"))
            lines += [
                c(DIM, "[observation") + (", " + ", ".join(tags) if tags else "") + c(DIM, "]"),
                turn["observation"].rstrip(),
            ]
        lines.append("")
    if t.get("final_observation"):
        lines += [c(DIM, "[final observation]"), t["final_observation"].rstrip(), ""]
    if t["rewards"]:
        lines.append(c(BOLD, "reward vector"))
        for name, comp in sorted(t["rewards"].items()):
            if isinstance(comp, dict):
                value = comp.get("value")
                extra = comp.get("reason") or (json.dumps(comp["details"]) if comp.get("details") else "")
                lines.append(f"  {name:<20} {'–' if value is None else f'{value:.3f}'}  {extra}".rstrip())
            else:
                lines.append(f"  {name:<20} {comp}")
    return "\n".join(lines)


def cmd_transcript(args: argparse.Namespace) -> int:
    with client(args) as api:
        t = api.transcript(args.episode)
    if args.json:
        out(json.dumps(t, indent=2))
    else:
        out(render_transcript(t, color=sys.stdout.isatty()))
    return 0


# --- admin ------------------------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    """The plugins installed in this Python environment (run it in a service's image)."""
    from temper import plugins

    table = {
        group.value: {
            name: {"dist": p.dist, "target": p.value} for name, p in sorted(plugins.installed(group).items())
        }
        for group in plugins.Group
    }
    if args.json:
        sys.stdout.write(json.dumps(table, indent=2) + "\n")
        return 0
    for group, found in table.items():
        sys.stdout.write(f"{group}\n")
        for name, p in found.items():
            sys.stdout.write(f"  {name:<16} {p['dist']:<20} {p['target']}\n")
    return 0


def cmd_create_tenant(args: argparse.Namespace) -> int:
    """Create a tenant straight in the database (TEMPER_DB__URL): how the first key is made."""
    import asyncio

    from temper.db import Database, DatabaseUnavailable
    from temper.runtime import StartupError, load_settings
    from temper.tenants import TenantExists, create_tenant

    try:
        settings = load_settings()
    except StartupError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2

    async def create() -> tuple[str, str]:
        db = Database(settings.db)
        try:
            await db.check()
            async with db.session() as session:
                tenant, issued = await create_tenant(
                    session,
                    name=args.name,
                    tenant_id=args.id,
                    max_concurrent_episodes=args.max_concurrent_episodes,
                    admin=args.admin,
                    weight=args.weight,
                    quota_sandbox_cpu_s=args.quota_sandbox_cpu_s,
                    quota_inference_tokens=args.quota_inference_tokens,
                    quota_sandbox_memory_gb_s=args.quota_sandbox_memory_gb_s,
                    quota_trainer_s=args.quota_trainer_s,
                )
            return tenant.id, issued.key
        finally:
            await db.dispose()

    try:
        tenant_id, key = asyncio.run(create())
    except (TenantExists, DatabaseUnavailable) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stderr.write(f"created tenant {tenant_id!r}; its API key follows (shown once, store it now):\n")
    out(key)
    return 0


def add_commands(sub: Any) -> None:

    p = sub.add_parser("submit", help="submit a job spec (YAML or JSON file, '-' for stdin)")
    p.add_argument("spec")
    p.add_argument("--watch", action="store_true", help="then watch it until it ends")
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--state")
    p.add_argument("--name", help="name contains")
    p.add_argument("--tag", help="only jobs with this tag")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser(
        "show", help="a job: its state and what it was made from (JOB: its id, handle or name)"
    )
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="the job as the API gives it (spec and provenance)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rerun", help="submit a job's resolved spec again as a new job; prints the new id")
    p.add_argument("job")
    p.add_argument("--handle", help="the new job's handle (the old job keeps its own)")
    p.add_argument("--name", help="the new job's name (default: the same)")
    p.add_argument("--watch", action="store_true", help="then watch it until it ends")
    p.add_argument("--interval", type=float, default=2.0)
    p.set_defaults(func=cmd_rerun)

    p = sub.add_parser("watch", help="live progress of a job until it ends")
    p.add_argument("job")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("transcript", help="an episode's transcript")
    p.add_argument("episode")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_transcript)

    p = sub.add_parser("tag", help="change a job's tags or note (JOB: its id, handle or name)")
    p.add_argument("job")
    p.add_argument("--set", nargs="*", metavar="TAG", help="the job's tags from now on (none: clear them)")
    p.add_argument("--note", help="the job's note ('' clears it)")
    p.set_defaults(func=cmd_tag)

    for action in ("pause", "resume", "cancel"):
        p = sub.add_parser(action, help=f"{action} a job")
        p.add_argument("job")
        p.set_defaults(func=_control(action))

    admin = sub.add_parser("admin", help="administration (talks to the database named by TEMPER_DB__URL)")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True, metavar="ADMIN_COMMAND")
    p = admin_sub.add_parser("create-tenant", help="create a tenant and print its first API key")
    p.add_argument("name")
    p.add_argument("--id", help="tenant id (default: a slug of NAME)")
    p.add_argument("--max-concurrent-episodes", type=int, default=64)
    p.add_argument("--weight", type=number(float, above=0.0), default=1.0, help="share of a contended fleet")
    p.add_argument(
        "--quota-sandbox-cpu-s",
        type=number(float),
        help="sandbox CPU-seconds it may use (default: no limit)",
    )
    p.add_argument(
        "--quota-inference-tokens", type=number(int), help="inference tokens it may use (default: no limit)"
    )
    p.add_argument(
        "--quota-sandbox-memory-gb-s",
        type=number(float),
        help="sandbox memory it may hold, in GB-seconds (default: no limit)",
    )
    p.add_argument(
        "--quota-trainer-s",
        type=number(float),
        help="trainer seconds its steps may take (default: no limit)",
    )
    p.add_argument("--admin", action="store_true", help="make the key an admin key")
    p.set_defaults(func=cmd_create_tenant)
    p = admin_sub.add_parser("plugins", help="list the environment, reward and parser plugins installed here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)
