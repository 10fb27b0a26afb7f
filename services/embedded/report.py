"""The run's report: ``summary.json``, ``reward_curve.png`` and ``report.html`` (reward
curve and, with an ``evaluation``, the eval curve beside it; pass rates per task; the
evaluations per version and per task; the job's provenance; a few transcripts), written
into the run directory."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher import evaluation_views
from services.dispatcher.api.repo import job_metrics
from services.dispatcher.api.schemas import EvaluationPoint, IterationReward, JobMetrics, Transcript
from services.dispatcher.api.transcripts import transcript
from services.dispatcher.console.charts import CHART_CSS, eval_curve_svg, reward_curve_svg
from temper.db import Episode, Job
from temper.jobspec import OFFLINE_DATA, reward_weights
from temper.storage import ObjectStore

TRANSCRIPTS_SHOWN = 4
OFFLINE_NAMES = {a.value for a in OFFLINE_DATA}


async def write_report(
    session: AsyncSession,
    store: ObjectStore,
    job: Job,
    run_dir: Path,
    *,
    seconds: float,
    before: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    metrics = await job_metrics(session, job=job)
    curve = metrics.reward_curve
    summary = {
        "job_id": job.id,
        "name": job.name,
        "state": job.state,
        "state_reason": job.state_reason,
        "iterations": len(curve),
        "first_mean_reward": curve[0].mean if curve else 0.0,
        "last_mean_reward": curve[-1].mean if curve else 0.0,
        "reward_curve": [c.model_dump() for c in curve],
        "pass_rates": [p.model_dump() for p in metrics.pass_rates],
        "policy_version": job.policy_version,
        "episodes_by_state": metrics.progress.episodes_by_state,
        "training": metrics.training.model_dump(mode="json"),  # the trainer's numbers per version
        "evaluations": [e.model_dump(mode="json") for e in metrics.evaluations],
        "provenance": job.provenance,
        "seconds": round(seconds, 1),
    }
    done = [e for e in metrics.evaluations if e.state == "completed" and e.version is not None]
    if done:  # the held-out pass@1 of the first and the last version evaluated
        summary["first_eval"] = {"version": done[0].version, "pass_at": done[0].pass_at}
        summary["last_eval"] = {"version": done[-1].version, "pass_at": done[-1].pass_at}
    if (job.spec.get("algorithm") or {}).get("name") in OFFLINE_NAMES:
        # the loss of the first and the last version (each the loss of its last step)
        losses = [v.loss for v in metrics.training.versions if v.loss is not None]
        summary["first_loss"] = losses[0] if losses else None
        summary["last_loss"] = losses[-1] if losses else None
    if "judge" in (job.spec.get("rewards") or {}):
        summary["judge"] = await judge_summary(session, job.id)
    if before:
        summary["before"] = before
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_reward_curve(curve, run_dir / "reward_curve.png", title=job.name, evaluations=metrics.evaluations)
    episodes = await _sample_episodes(session, job.id)
    transcripts = [await transcript(session, store, e) for e in episodes]
    latest = done[-1] if done else None
    tasks = (await evaluation_views.task_rows(session, [latest.evaluation_job_id])) if latest else {}
    per_task = tasks.get(latest.evaluation_job_id, []) if latest else []
    (run_dir / "report.html").write_text(_html(job, metrics, summary, transcripts, latest, per_task))
    return summary


async def judge_summary(session: AsyncSession, job_id: str) -> dict[str, Any]:
    """The job's judge verdicts: how many scored, unparsable or unanswered, and on code
    tasks how often the verdict (value >= 0.5) agreed with the hidden tests passing (what
    code can check), over the episodes that have both."""
    rows = (await session.execute(select(Episode.rewards).where(Episode.job_id == job_id))).scalars()
    scored = unparsable = unanswered = checked = agree = 0
    for rewards in rows:
        judge = (rewards or {}).get("judge")
        if not isinstance(judge, dict):
            continue
        if not judge.get("ok", True):
            if "verdict" in (judge.get("details") or {}):
                unparsable += 1
            else:
                unanswered += 1
            continue
        scored += 1
        tests = (rewards or {}).get("tests_passed")
        if isinstance(tests, dict) and tests.get("ok", True) and tests.get("value") is not None:
            checked += 1
            agree += (judge["value"] >= 0.5) == (tests["value"] == 1.0)
    return {
        "scored": scored,
        "unparsable": unparsable,
        "unanswered": unanswered,
        "checked_against_tests": checked,
        "agreement_with_tests": round(agree / checked, 4) if checked else None,
    }


def plot_reward_curve(
    curve: list[IterationReward], path: Path, *, title: str, evaluations: list[EvaluationPoint] | None = None
) -> None:
    """The mean reward per iteration; with finished evaluations, pass@k per version on the
    evaluated tasks in a panel beside it."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    done = [e for e in evaluations or [] if e.state == "completed" and e.version is not None and e.pass_at]
    if done:
        fig, (ax, ev) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110)
        _plot_evaluations(ev, done)
    else:
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    xs = [c.iteration + 1 for c in curve]  # counted from 1, as the console counts them
    means = [c.mean for c in curve]
    lo = [max(c.mean - c.std, c.min) for c in curve]  # the band stays inside the rewards seen
    hi = [min(c.mean + c.std, c.max) for c in curve]
    ax.fill_between(xs, lo, hi, alpha=0.2, color="#2f6fb3", label="± 1 std")
    ax.plot(xs, means, marker="o", color="#2f6fb3", label="mean reward")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title(f"{title}: reward per iteration")
    ax.set_ylim(min([0.0, *lo]) - 0.05, max([1.0, *hi]) + 0.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_evaluations(ax: Any, done: list[EvaluationPoint]) -> None:
    """pass@k per version (one label: the first) and the mean reward of the evaluated episodes."""
    label = sorted({e.label for e in done})[0]
    done = sorted((e for e in done if e.label == label), key=lambda e: e.version or 0)
    ks = sorted({k for e in done for k in e.pass_at}, key=int)
    colors = ("#d9480f", "#2b8a3e", "#862e9c", "#e67700")
    for i, k in enumerate(ks):
        have = [(e.version, e.pass_at[k]) for e in done if e.pass_at.get(k) is not None]
        ax.plot([v for v, _ in have], [y for _, y in have], marker="o", color=colors[i % len(colors)],
                label=f"pass@{k}")  # fmt: skip
    rewards = [(e.version, e.reward_mean) for e in done if e.reward_mean is not None]
    ax.plot([v for v, _ in rewards], [r for _, r in rewards], linestyle="--", color="#2f6fb3",
            label="mean reward")  # fmt: skip
    where = {"held_out": "held-out tasks", "train": "training tasks"}.get(done[0].split, "every task")
    ax.set_xlabel("policy version")
    ax.set_ylabel("evaluation")
    ax.set_title(f"eval on {where}: {done[0].samples} samples a task")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


async def _sample_episodes(session: AsyncSession, job_id: str) -> list[Episode]:
    """The best and worst scored episodes of the first and the last iteration."""
    rows = list(
        (
            await session.execute(
                select(Episode)
                .where(Episode.job_id == job_id, Episode.reward.is_not(None))
                .order_by(Episode.iteration)
            )
        ).scalars()
    )
    if not rows:
        return []
    first, last = rows[0].iteration, rows[-1].iteration
    picked: list[Episode] = []
    for iteration in (first, last):
        of_it = sorted((e for e in rows if e.iteration == iteration), key=lambda e: e.reward or 0.0)
        for e in (of_it[0], of_it[-1]):
            if e not in picked:
                picked.append(e)
    return picked[:TRANSCRIPTS_SHOWN]


def _components(rewards: dict[str, Any], weights: dict[str, float]) -> str:
    """The reward components as a table; the weighted ones (those the reward sums) marked."""
    from services.dispatcher.console.routes import reward_rows

    body = "".join(
        f"<tr class='{'weighted' if r['weight'] is not None else 'unweighted'}'><td>{escape(r['name'])}"
        f"{' (weighted)' if r['weight'] is not None else ''}</td>"
        f"<td>{'–' if r['value'] is None else format(r['value'], '.3f')}</td>"
        f"<td>{'not weighted' if r['weight'] is None else r['weight']}</td>"
        f"<td>{escape(', '.join(f'{k} {v}'.strip() for k, v in sorted(r['details'].items()))[:500])}</td></tr>"
        for r in reward_rows(rewards, weights)
    )
    return f"<table class='rewards'><tr><th>component</th><th>value</th><th>weight</th><th>details</th></tr>{body}</table>"


def _evaluation_html(
    metrics: JobMetrics, latest: EvaluationPoint | None, per_task: list[dict[str, Any]]
) -> str:
    """The evaluations per version and the newest one per task."""
    if not metrics.evaluations:
        return ""
    ks = sorted({k for e in metrics.evaluations for k in e.pass_at}, key=int)

    def num(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}"

    rows = "".join(
        f"<tr><td>{'v' + str(e.version) if e.version is not None else escape(e.model or '')}</td><td>{escape(e.label)}</td>"
        f"<td>{escape(e.taskset)}:{escape(e.split)}</td><td>{escape(e.state)}</td>"
        + "".join(f"<td>{num(e.pass_at.get(k))}</td>" for k in ks)
        + f"<td>{num(e.reward_mean)}</td></tr>"
        for e in metrics.evaluations
    )
    head = "".join(f"<th>pass@{escape(k)}</th>" for k in ks)
    out = (
        f"<h2>Evaluation per version</h2>{eval_curve_svg(metrics.evaluations)}"
        f"<table><tr><th>version</th><th>label</th><th>tasks</th><th>state</th>{head}<th>mean reward</th></tr>{rows}</table>"
    )
    if latest is not None and per_task:
        tks = sorted({k for t in per_task for k in t["pass_at"]}, key=int)
        body = "".join(
            f"<tr><td>{escape(t['task_id'])}</td><td>{t['samples']}</td><td>{t['passed']}</td>"
            + "".join(f"<td>{num(t['pass_at'].get(k))}</td>" for k in tks)
            + f"<td>{num(t['reward_mean'])}</td></tr>"
            for t in per_task
        )
        out += (
            f"<h3>Per task at v{latest.version}</h3><table><tr><th>task</th><th>samples</th><th>passed</th>"
            + "".join(f"<th>pass@{escape(k)}</th>" for k in tks)
            + f"<th>mean reward</th></tr>{body}</table>"
        )
    return out


def _provenance_html(provenance: dict[str, Any] | None) -> str:
    if not provenance:
        return "<h2>Provenance</h2><p>Not recorded.</p>"
    src, model, ts = (
        provenance.get("temper") or {},
        provenance.get("model") or {},
        provenance.get("taskset") or {},
    )
    commit = src.get("commit") or f"unknown: {src.get('commit_unknown') or 'not recorded'}"
    if src.get("dirty"):
        commit += " (with uncommitted changes)"
    seeds = ", ".join(f"{k}={v}" for k, v in sorted((provenance.get("seeds") or {}).items())) or "–"
    facts = [
        ("Temper", f"{src.get('version', '?')}, commit {commit}"),
        ("seeds", seeds),
        ("spec sha256", provenance.get("spec_sha256") or "–"),
        (
            "model",
            f"{model.get('policy_model', '–')} (initial weights: {model.get('init') or '–'}, {model.get('source') or '–'})",
        ),
        (
            "model sha256",
            model.get("sha256") or f"none ({model.get('note') or model.get('source') or 'not readable'})",
        ),
        (
            "task set",
            f"{ts.get('id', '–')} ({ts.get('name') or '–'}, {ts.get('tasks', 0)} tasks), sha256 {ts.get('sha256', '–')}",
        ),
    ]
    if provenance.get("rerun_of"):
        facts.append(("rerun of", provenance["rerun_of"]))
    rows = "".join(f"<tr><th>{escape(k)}</th><td class='text'>{escape(str(v))}</td></tr>" for k, v in facts)
    return f"<h2>Provenance</h2><table class='provenance'>{rows}</table>"


def _html(
    job: Job,
    metrics: JobMetrics,
    summary: dict[str, Any],
    transcripts: list[Transcript],
    latest: EvaluationPoint | None = None,
    per_task: list[dict[str, Any]] | None = None,
) -> str:
    weights = reward_weights((job.spec or {}).get("rewards") or {})
    rows = "".join(
        f"<tr><td>{escape(p.task_id)}</td><td>{p.episodes}</td><td>{p.pass_rate:.2f}</td><td>{p.mean_reward:.3f}</td></tr>"
        for p in metrics.pass_rates
    )
    blocks = []
    for t in transcripts:
        ep = t.episode
        turns = "".join(
            f"<h4>turn {turn.turn + 1}</h4>"
            + (f"<pre class='prompt'>{escape(turn.prompt)}</pre>" if turn.turn == 0 else "")
            + f"<pre class='action'>{escape(turn.action_text)}</pre>"
            + (f"<pre class='obs'>{escape(turn.observation)}</pre>" if turn.observation else "")
            + (f"<p class='kill'>killed: {escape(turn.kill_reason)}</p>" if turn.kill_reason else "")
            for turn in t.turns
        )
        reward = "–" if t.reward is None else f"{t.reward:.3f}"
        blocks.append(
            f"<section><h3>episode {escape(ep.id)} · task {escape(ep.task_id)} · iteration {ep.iteration + 1} · "
            f"reward {reward}</h3>{turns}"
            f"<details><summary>reward vector</summary>{_components(t.rewards, weights)}</details></section>"
        )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Temper run: {escape(job.name)}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }}
pre {{ background: #f5f5f7; padding: .6em; overflow-x: auto; white-space: pre-wrap; }}
pre.action {{ border-left: 3px solid #2f6fb3; }} pre.obs {{ border-left: 3px solid #999; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ddd; padding: .25em .6em; text-align: right; }}
.kill {{ color: #b00; }} tr.unweighted td {{ color: #888; }} td.text {{ text-align: left; font-family: monospace; }}
{CHART_CSS}
</style></head><body>
<h1>{escape(job.name)} <small>({escape(job.id)}, {escape(job.state)})</small></h1>
<p>Mean reward {summary["first_mean_reward"]:.3f} in the first iteration, {summary["last_mean_reward"]:.3f} in the
last; {summary["iterations"]} iterations, policy version {summary["policy_version"]}, {summary["seconds"]:.0f} s.</p>
<h2>Reward curve</h2>{reward_curve_svg(metrics.reward_curve)}
{_evaluation_html(metrics, latest, per_task or [])}
<h2>Pass rates per task</h2>
<table><tr><th>task</th><th>episodes</th><th>pass rate</th><th>mean reward</th></tr>{rows}</table>
{_provenance_html(job.provenance)}
<h2>Transcripts (best and worst of the first and last iteration)</h2>{"".join(blocks)}
</body></html>
"""
