"""Learning speed on one machine: Temper's example job against TRL's GRPOTrainer, in one run.

Both sides learn the example task (``examples/code-job.yaml``: one-line functions that must
pass hidden tests) from **the same warm-started policy** (the example's supervised warm
start, made once here and saved as ``policy-v0``), with **the same prompt token ids**
(Temper's code environment rendered by the policy's chat template; checked against what
Temper's episodes sent the engine), **the same reward** (Temper's parser and test harness:
``bench/learn_trl.py``; checked to give Temper's reward on Temper's own episodes) and the
same settings (72 samples a batch as 9 groups of 8, temperature 1, at most 128 new
tokens, GRPO with group-normalised advantages, token-mean loss, clip 0.2, no KL,
AdamW at 3e-4, gradient clipping at 1.0, one optimizer step a batch, 20 batches).

- **Temper**: ``temper run`` of the example job with ``policy.model`` = that ``policy-v0``
  and no warm start (embedded mode: every service in one process, SQLite, the in-process
  bus, real bubblewrap sandboxes, the CPU engine). Read from the run's database.
- **TRL, bwrap**: ``GRPOTrainer``, each reward run of the harness in a bubblewrap sandbox.
- **TRL, plain**: the same, each run a plain subprocess (no isolation).

The three alternate ``--rounds`` times (the order reversed every other round) and the
figures are medians over the rounds; each ratio is the median of the rounds' ratios
(each measured in one round, under the same load). Per side:

- ``samples_per_s``: scored samples over the RL time (from the first episode, or
  ``train()``'s start, to the last trained version, or the last step's end);
- ``seconds_to_0_75``: from the start of RL to the first batch whose mean together with
  the two before it is >= 0.75 (a batch is an iteration of Temper's, a step of TRL's; its
  time is when its last reward was known); null when never reached;
- ``reward_at_equal_time``: the mean of the last 3 batches done by the time the fastest
  of the three sides of the round had finished.

A side that never reaches 0.75 in its batches has a time to it longer than its RL time, so
the time ratio of a round is bounded rather than unknown: if only TRL missed, Temper's
ratio is below ``Temper's time / TRL's RL time`` (that bound is the round's figure, shown
``<x``); if Temper missed, the round counts as infinitely slow (``never``), whatever TRL
did. Each round's figure is thus no smaller than its true ratio, so their median is no
smaller than the true median: a median at or below 1.0 says Temper was at least as fast.
A side's own ``seconds_to_0_75`` median counts a miss as infinitely slow too; a median
that lands on a miss is null.

``--profile`` runs one more Temper job under ``bench/learn_profile.py`` and prints where
its CPU went (the table in docs/training.md); ``--policy DIR`` reuses a warm-started
policy. Writes ``bench/results/learn.json`` (``--out``) and prints a table.

    python bench/learn.py [--rounds 3] [--iterations 20] [--policy DIR] [--profile]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]
EXAMPLE = ROOT / "examples" / "code-job.yaml"
TARGET = 0.75
SIDES = ("temper", "trl_bwrap", "trl_plain")


# --- setup ---------------------------------------------------------------------------------------
def warm_policy(work: Path) -> Path:
    """The example's warm start, once: ``work/policy-v0``."""
    from services.embedded import localrun
    from services.embedded.runner import Progress, make_policy

    spec, local = localrun.load(EXAMPLE)
    t0 = time.perf_counter()
    make_policy(spec, local, work, Progress(sys.stderr))
    print(f"warm start: {time.perf_counter() - t0:.0f}s -> {work / 'policy-v0'}", file=sys.stderr)
    return work / "policy-v0"


def derived_spec(policy: Path, work: Path, iterations: int) -> Path:
    """The example job starting from ``policy`` (no warm start of its own)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["policy"]["model"] = str(policy.resolve())
    doc["schedule"]["iterations"] = iterations
    local = doc["local"]
    local.pop("warm_start", None)
    # TRL's side evaluates nothing between its steps: the example's periodic evaluation of
    # held-out tasks would be extra work on the same two cores, so this side leaves it out
    doc.pop("evaluation", None)
    local["taskset_file"] = str((EXAMPLE.parent / local["taskset_file"]).resolve())
    path = work / "code-job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --- Temper --------------------------------------------------------------------------------------
def _t(text: str) -> float:
    """A naive UTC timestamp of the database as unix time."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def temper_run(spec: Path, work: Path, run_id: str, *, profile: Path | None = None) -> Path:
    runs = work / "runs"
    if profile is None:
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            str(spec),
            "--runs-dir",
            str(runs),
            "--run-id",
            run_id,
        ]
    else:
        cmd = [
            sys.executable,
            str(ROOT / "bench" / "learn_profile.py"),
            str(spec),
            str(runs),
            run_id,
            str(profile),
        ]
    with (work / f"{run_id}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    return runs / run_id


def temper_side(run_dir: Path) -> dict[str, Any]:
    """Batches (iterations), RL time and what was trained, from the run's database."""
    db = sqlite3.connect(run_dir / "temper.db")
    # the job that learns: an evaluation job (spec.evaluate) is not a batch of training samples
    ((job_id,),) = db.execute("select id from jobs where json_extract(spec, '$.evaluate') is null").fetchall()
    start = _t(db.execute("select min(created_at) from episodes where job_id = ?", (job_id,)).fetchone()[0])
    rows = db.execute(
        "select e.iteration, e.reward, max(s.completed_at) from episodes e join steps s"
        " on s.episode_id = e.id and s.kind = 'reward' where e.reward is not null and e.job_id = ?"
        " group by e.id",
        (job_id,),
    ).fetchall()
    by_iteration: dict[int, list[tuple[float, float]]] = {}
    for iteration, reward, at in rows:
        by_iteration.setdefault(iteration, []).append((float(reward), _t(at)))
    batches = [
        {
            "rewards_at": max(t for _, t in eps) - start,
            "mean": statistics.fmean(r for r, _ in eps),
            "samples": len(eps),
        }
        for _, eps in sorted(by_iteration.items())
    ]
    versions = [
        _t(v)
        for (v,) in db.execute(
            "select created_at from policy_versions where job_id = ? order by version", (job_id,)
        )
    ]
    end = max([*versions, *(start + b["rewards_at"] for b in batches)])
    skipped = dict(
        db.execute(
            "select coalesce(skipped, 'trained'), count(*) from trained_trajectories where job_id = ? group by 1",
            (job_id,),
        )
    )
    return {
        "batches": batches,
        "rl_s": end - start,
        "samples": sum(b["samples"] for b in batches),
        "trained": skipped.pop("trained", 0),
        "skipped": skipped,
        "versions": len(versions),
        "start": start,
        "end": end,
    }


def check_trl_side(spec: Path, run_dir: Path) -> dict[str, Any]:
    """Temper's episodes through the TRL side's prompt and reward: how many prompts are the
    ids Temper's engine was sent, and how many rewards are Temper's (harness unsandboxed)."""
    import asyncio

    from learn_trl import Reward, SubprocessRuns, environment, load_task_side

    job_spec, tasks, tok = load_task_side(spec)
    index = {t.id: i for i, t in enumerate(tasks)}
    prompts = [environment(job_spec, t).first_prompt_ids(tok) for t in tasks]
    db = sqlite3.connect(run_dir / "temper.db")
    rows = db.execute(
        "select t.key, s.request, s.result, e.reward from episodes e join tasks t on t.id = e.task_id"
        " join steps s on s.episode_id = e.id and s.kind = 'inference' where e.reward is not null"
    ).fetchall()
    items, want, same_prompt = [], [], 0
    for key, request, result, reward in rows:
        i = index[key]
        same_prompt += json.loads(request)["prompt_ids"] == prompts[i]
        items.append((i, json.loads(result)["token_ids"]))
        want.append(float(reward))
    reward = Reward(job_spec, tasks, tok, SubprocessRuns("plain", os.cpu_count() or 2))
    got = asyncio.run(reward.score_all(items))
    agree = sum(abs(w - g) < 1e-9 for w, g in zip(want, got, strict=True))
    return {"episodes": len(items), "same_prompt_ids": same_prompt, "same_reward": agree}


# --- TRL -----------------------------------------------------------------------------------------
def trl_side(spec: Path, work: Path, mode: str, seed: int, iterations: int) -> dict[str, Any]:
    out = work / f"trl-{mode}-{seed}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "learn_trl.py"), "--spec", str(spec), "--mode", mode,
           "--out", str(out), "--seed", str(seed), "--iterations", str(iterations)]  # fmt: skip
    with (work / f"trl-{mode}-{seed}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    return dict(json.loads(out.read_text()))


# --- figures -------------------------------------------------------------------------------------
def to_target(batches: list[dict[str, Any]]) -> float | None:
    for k in range(2, len(batches)):
        if statistics.fmean(b["mean"] for b in batches[k - 2 : k + 1]) >= TARGET:
            return float(batches[k]["rewards_at"])
    return None


def reward_by(batches: list[dict[str, Any]], seconds: float) -> float | None:
    done = [b["mean"] for b in batches if b["rewards_at"] <= seconds + 1e-9]
    return statistics.fmean(done[-3:]) if done else None


def figures(side: dict[str, Any], equal_s: float) -> dict[str, Any]:
    b = side["batches"]
    return {
        "samples_per_s": side["samples"] / side["rl_s"],
        "seconds_to_0_75": to_target(b),
        "reward_at_equal_time": reward_by(b, equal_s),
        "rl_s": side["rl_s"],
        "last_3_batches": statistics.fmean(x["mean"] for x in b[-3:]),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def middle(items: list[Any]) -> list[Any]:
    """The one or two of ``items``, sorted, that their median is the mean of."""
    ordered = sorted(items)
    return ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]


def median_of_times(values: list[float | None]) -> float | None:
    """The median of times to 0.75, a miss (None) counting as infinitely long; null when the
    median is a miss."""
    m = statistics.fmean(middle([math.inf if v is None else v for v in values]) or [math.inf])
    return None if math.isinf(m) else m


def time_ratio(temper: dict[str, Any], other: dict[str, Any]) -> tuple[float, bool]:
    """One round's Temper-over-other time to 0.75, as a value no smaller than the true
    ratio, and whether it is a bound: exact when both reached it; below Temper's time over
    the other's RL time when only the other missed (its time is longer than all it ran);
    infinite when Temper missed."""
    mine, theirs = temper["seconds_to_0_75"], other["seconds_to_0_75"]
    if mine is None:
        return math.inf, False
    if theirs is None:
        return mine / other["rl_s"], True
    return mine / theirs, False


def _rounds(values: list[float | None]) -> str:
    """Each round's figure, as one string: bench results are flat objects of scalars."""
    return ", ".join("null" if v is None else str(round(v, 3)) for v in values)


def _bounded_rounds(values: list[tuple[float, bool]]) -> str:
    return ", ".join(
        "never" if math.isinf(v) else f"{'<' if bound else ''}{round(v, 3)}" for v, bound in values
    )


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for side in SIDES:
        for key in ("samples_per_s", "seconds_to_0_75", "reward_at_equal_time", "rl_s", "last_3_batches"):
            values = [r[side][key] for r in rounds]
            m = median_of_times(values) if key == "seconds_to_0_75" else median(values)
            result[f"{side}_{key}"] = None if m is None else round(m, 3)
    for other in ("trl_bwrap", "trl_plain"):
        per = [ratio(r["temper"]["samples_per_s"], r[other]["samples_per_s"]) for r in rounds]
        to = [time_ratio(r["temper"], r[other]) for r in rounds]
        result[f"samples_per_s_over_{other}"] = None if median(per) is None else round(median(per), 3)  # type: ignore[arg-type]
        mid = middle(to)
        m = statistics.fmean(v for v, _ in mid)
        result[f"seconds_to_0_75_over_{other}"] = None if math.isinf(m) else round(m, 3)
        # true when the median rests on a round whose figure is a bound (the ratio is below it)
        result[f"seconds_to_0_75_over_{other}_is_bound"] = any(b for _, b in mid)
        result[f"rounds_samples_per_s_over_{other}"] = _rounds(per)
        result[f"rounds_seconds_to_0_75_over_{other}"] = _bounded_rounds(to)
    return result


def print_table(result: dict[str, Any]) -> None:
    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [("", "Temper", "TRL bwrap", "TRL plain")]
    for key, label, fmt in (
        ("rl_s", "RL time (s)", ".1f"),
        ("samples_per_s", "samples/s", ".2f"),
        ("seconds_to_0_75", "s to 3-batch mean >= 0.75", ".1f"),
        ("reward_at_equal_time", "reward at equal time", ".3f"),
        ("last_3_batches", "mean of the last 3 batches", ".3f"),
    ):
        rows.append((label, *(cell(result[f"{s}_{key}"], fmt) for s in SIDES)))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width, strict=True))
            )
        )
    print(
        f"Temper / TRL bwrap: samples/s {cell(result['samples_per_s_over_trl_bwrap'], '.2f')}, "
        f"time to 0.75 {'<' * result['seconds_to_0_75_over_trl_bwrap_is_bound']}"
        f"{cell(result['seconds_to_0_75_over_trl_bwrap'], '.2f')} ({result['rounds_seconds_to_0_75_over_trl_bwrap']})   "
        f"(TRL plain: {cell(result['samples_per_s_over_trl_plain'], '.2f')}, "
        f"{cell(result['seconds_to_0_75_over_trl_plain'], '.2f')})"
    )


def slug(text: str) -> str:
    return "_".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def profile(spec: Path, work: Path) -> dict[str, Any]:
    """One more Temper run under the sampling profiler: CPU seconds by part over its RL time."""
    from learn_profile import window

    out = work / "profile.json"
    run_dir = temper_run(spec, work, "temper-profile", profile=out)
    data = json.loads(out.read_text())
    side = temper_side(run_dir)
    used = window(data["ticks"], data["children"], side["start"], side["end"])
    wall = side["end"] - side["start"]
    cores = os.cpu_count() or 1
    used["idle (cores x RL time - all the above)"] = max(0.0, cores * wall - sum(used.values()))
    print(f"\nwhere the CPU went in {wall:.1f}s of RL ({cores} cores, {cores * wall:.0f} core-seconds):")
    for part, s in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<42} {s:7.1f} s  {100 * s / (cores * wall):5.1f} %")
    return {
        "rl_s": wall,
        "cores": cores,
        "cpu_s": used,
        "run": str(run_dir),
        **{k: side[k] for k in ("skipped", "trained")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--policy", default=None, help="a warm-started policy-v0 directory to reuse")
    ap.add_argument("--work", default=None, help="where runs and logs go (default: a temporary directory)")
    ap.add_argument("--profile", action="store_true", help="also profile one Temper run (docs/training.md)")
    ap.add_argument("--profile-only", action="store_true", help="only the profile, no comparison")
    ap.add_argument(
        "--skip-check", action="store_true", help="do not check the TRL side's prompts and rewards"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learn.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    work = Path(args.work or tempfile.mkdtemp(prefix="temper-bench-learn-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)  # sandboxes run as nobody: the run directories must be reachable
    policy = Path(args.policy) if args.policy else warm_policy(work)
    spec = derived_spec(policy, work, args.iterations)
    load_before = os.getloadavg()[0]
    if args.profile_only:
        profile(spec, work)
        return
    rounds: list[dict[str, dict[str, Any]]] = []
    check: dict[str, Any] | None = None
    for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        sides: dict[str, dict[str, Any]] = {}
        for side in order:
            t0 = time.perf_counter()
            if side == "temper":
                run_dir = temper_run(spec, work, f"temper-{r}")
                sides[side] = temper_side(run_dir)
                if check is None and not args.skip_check:
                    check = check_trl_side(spec, run_dir)
            else:
                sides[side] = trl_side(spec, work, side.removeprefix("trl_"), r, args.iterations)
            print(f"round {r + 1}/{args.rounds} {side}: {time.perf_counter() - t0:.0f}s, RL {sides[side]['rl_s']:.1f}s",
                  file=sys.stderr)  # fmt: skip
        equal_s = min(s["rl_s"] for s in sides.values())
        rounds.append({side: {**figures(s, equal_s), "raw": s} for side, s in sides.items()})
    result = summarise(rounds)
    temper_raw = [r["temper"]["raw"] for r in rounds]
    result.update(
        {
            "temper_trained_samples": statistics.median(t["trained"] for t in temper_raw),
            "temper_stale_samples": statistics.median(t["skipped"].get("stale", 0) for t in temper_raw),
            "temper_zero_variance_samples": statistics.median(
                t["skipped"].get("zero_reward_variance", 0) for t in temper_raw
            ),
            "temper_versions": statistics.median(t["versions"] for t in temper_raw),
            "check_episodes": None if check is None else check["episodes"],
            "check_same_prompt_ids": None if check is None else check["same_prompt_ids"],
            "check_same_reward": None if check is None else check["same_reward"],
            "rounds": args.rounds,
            "iterations": args.iterations,
            "samples_per_batch": temper_raw[0]["batches"][0]["samples"] if temper_raw[0]["batches"] else None,
            "trl_reward_workers": rounds[0]["trl_bwrap"]["raw"]["reward_workers"],
            "trl_torch_threads": rounds[0]["trl_bwrap"]["raw"]["torch_threads"],
            "load_average_1m_before": round(load_before, 2),
            "load_average_1m_after": round(os.getloadavg()[0], 2),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        }
    )
    if args.profile:
        profiled = profile(spec, work)
        result["profile_rl_s"] = round(profiled["rl_s"], 1)  # the profiled run's own (the profiler slows it)
        for part, seconds in profiled["cpu_s"].items():
            result[f"profile_cpu_s_{slug(part)}"] = round(seconds, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    (work / "rounds.json").write_text(json.dumps(rounds, indent=2))
    print_table(result)
    if check is not None:
        print(f"check: {check['same_prompt_ids']}/{check['episodes']} prompts, "
              f"{check['same_reward']}/{check['episodes']} rewards as Temper's")  # fmt: skip
    print(f"-> {args.out}   (runs and logs: {work})")


if __name__ == "__main__":
    main()
