"""The run's report: ``summary.json``, ``reward_curve.png`` and ``report.html`` (reward
curve, pass rates per task, a few transcripts), written into the run directory."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api.repo import job_metrics
from services.dispatcher.api.schemas import IterationReward, JobMetrics, Transcript
from services.dispatcher.api.transcripts import transcript
from services.dispatcher.console.charts import CHART_CSS, reward_curve_svg
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
        "seconds": round(seconds, 1),
    }
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
    plot_reward_curve(curve, run_dir / "reward_curve.png", title=job.name)
    episodes = await _sample_episodes(session, job.id)
    transcripts = [await transcript(session, store, e) for e in episodes]
    (run_dir / "report.html").write_text(_html(job, metrics, summary, transcripts))
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


def plot_reward_curve(curve: list[IterationReward], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

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


def _html(job: Job, metrics: JobMetrics, summary: dict[str, Any], transcripts: list[Transcript]) -> str:
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
.kill {{ color: #b00; }} tr.unweighted td {{ color: #888; }}
{CHART_CSS}
</style></head><body>
<h1>{escape(job.name)} <small>({escape(job.id)}, {escape(job.state)})</small></h1>
<p>Mean reward {summary["first_mean_reward"]:.3f} in the first iteration, {summary["last_mean_reward"]:.3f} in the
last; {summary["iterations"]} iterations, policy version {summary["policy_version"]}, {summary["seconds"]:.0f} s.</p>
<h2>Reward curve</h2>{reward_curve_svg(metrics.reward_curve)}
<h2>Pass rates per task</h2>
<table><tr><th>task</th><th>episodes</th><th>pass rate</th><th>mean reward</th></tr>{rows}</table>
<h2>Transcripts (best and worst of the first and last iteration)</h2>{"".join(blocks)}
</body></html>
"""
