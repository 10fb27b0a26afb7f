"""Charts drawn on the server as inline SVG (no JavaScript, no CDN)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from markupsafe import Markup

from services.dispatcher.api.schemas import IterationReward

# The chart's styles for a page without console.css (the run's report.html): without
# them an SVG polygon and polyline are filled black.
CHART_CSS = """
svg.chart { width: 100%; max-width: 680px; height: auto; display: block; }
svg.chart .grid { stroke: #e3e7ee; }
svg.chart .tick, svg.chart .axis { fill: #6b7280; font-size: 11px; }
svg.chart .band { fill: rgba(47, 111, 222, .15); stroke: none; }
svg.chart .mean { fill: none; stroke: #2f6fde; stroke-width: 2; }
svg.chart .point { fill: #2f6fde; }
svg.chart .series { fill: none; stroke-width: 2; }
svg.chart .legend-label { font-size: 12px; fill: #222; }
svg.chart.empty text { fill: #6b7280; }
"""


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + 1e-9:
        out.append(round(v, 10))
        v += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _x_ticks(x0: int, x1: int) -> list[int]:
    """Whole-number ticks from ``x0`` to ``x1``, the last one always among them (it is the
    newest point; a neighbour closer than half a step gives way to it)."""
    if x1 <= x0:
        return [x0]
    ticks = [int(t) for t in _ticks(x0, x1, min(8, max(1, x1 - x0))) if float(t).is_integer()]
    step = ticks[1] - ticks[0] if len(ticks) > 1 else x1 - x0
    if ticks and ticks[-1] != x1:
        if x1 - ticks[-1] < step / 2:
            ticks.pop()
        ticks.append(x1)
    return ticks


def reward_curve_svg(curve: Sequence[IterationReward], *, width: int = 680, height: int = 260) -> Markup:
    """Mean reward per iteration (counted from 1) with a ±1 std band clipped to the rewards seen (a band
    never claims a reward below the lowest or above the highest); each point has a tooltip."""
    if not curve:
        return Markup(
            f'<svg id="reward-curve" class="chart empty" viewBox="0 0 {width} 80" role="img" '
            'aria-label="reward curve"><text x="12" y="44">No scored episodes yet.</text></svg>'
        )
    left, right, top, bottom = 52, 16, 14, 34
    w, h = width - left - right, height - top - bottom
    xs = [p.iteration for p in curve]
    lo = min(p.min for p in curve)
    hi = max(p.max for p in curve)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    x0, x1 = min(xs), max(xs)

    def sx(x: float) -> float:
        return left + (w / 2 if x1 == x0 else (x - x0) / (x1 - x0) * w)

    def sy(y: float) -> float:
        return top + h - (y - lo) / (hi - lo) * h

    parts = [
        f'<svg id="reward-curve" class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="mean reward per iteration" data-points="{len(curve)}">'
    ]
    for t in _ticks(lo, hi):
        y = sy(t)
        parts.append(f'<line class="grid" x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for it in _x_ticks(x0, x1):
        parts.append(
            f'<text class="tick" x="{sx(it):.1f}" y="{top + h + 18}" text-anchor="middle">{it + 1}</text>'
        )
    parts.append(
        f'<text class="axis" x="{left + w / 2:.1f}" y="{height - 2}" text-anchor="middle">iteration</text>'
    )
    band = [f"{sx(p.iteration):.1f},{sy(min(p.mean + p.std, p.max)):.1f}" for p in curve]
    band += [f"{sx(p.iteration):.1f},{sy(max(p.mean - p.std, p.min)):.1f}" for p in reversed(curve)]
    parts.append(f'<polygon class="band" points="{" ".join(band)}"/>')
    mean_pts = " ".join(f"{sx(p.iteration):.1f},{sy(p.mean):.1f}" for p in curve)
    parts.append(f'<polyline class="mean" points="{mean_pts}"/>')
    for p in curve:
        tip = escape(
            f"iteration {p.iteration + 1}: mean {p.mean:.3f} ± {p.std:.3f} (min {p.min:.3f}, max {p.max:.3f}, "
            f"{p.episodes} episodes)"
        )
        parts.append(
            f'<circle class="point" cx="{sx(p.iteration):.1f}" cy="{sy(p.mean):.1f}" r="3.5"><title>{tip}</title></circle>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


PALETTE = ("#2f6fde", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c", "#495057")


def reward_curves_svg(
    series: Sequence[tuple[str, str, Sequence[IterationReward]]], *, width: int = 680, height: int = 280
) -> Markup:
    """Several jobs' mean reward per iteration (counted from 1) on one chart, one colour
    each (:data:`PALETTE` by position in ``series``, so a job without scored episodes
    keeps its colour unused), with a legend of their labels; ``series``: ``(job id, label,
    curve)``; the y axis spans the rewards seen."""
    drawn = [
        (job, label, curve, PALETTE[i % len(PALETTE)])
        for i, (job, label, curve) in enumerate(series)
        if curve
    ]
    if not drawn:
        return Markup(
            f'<svg id="compare-curves" class="chart empty" viewBox="0 0 {width} 80" role="img" '
            'aria-label="reward curves"><text x="12" y="44">None of these jobs has scored episodes yet.</text></svg>'
        )
    left, right, top, bottom = 52, 16, 14 + 16 * len(drawn), 34
    w, h = width - left - right, height - top - bottom
    points = [p for _, _, curve, _ in drawn for p in curve]
    lo, hi = min(p.min for p in points), max(p.max for p in points)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    x0, x1 = min(p.iteration for p in points), max(p.iteration for p in points)

    def sx(x: float) -> float:
        return left + (w / 2 if x1 == x0 else (x - x0) / (x1 - x0) * w)

    def sy(y: float) -> float:
        return top + h - (y - lo) / (hi - lo) * h

    parts = [
        f'<svg id="compare-curves" class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="mean reward per iteration of several jobs" data-series="{len(drawn)}">'
    ]
    for t in _ticks(lo, hi):
        y = sy(t)
        parts.append(f'<line class="grid" x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for it in _x_ticks(x0, x1):
        parts.append(
            f'<text class="tick" x="{sx(it):.1f}" y="{top + h + 18}" text-anchor="middle">{it + 1}</text>'
        )
    parts.append(
        f'<text class="axis" x="{left + w / 2:.1f}" y="{height - 2}" text-anchor="middle">iteration</text>'
    )
    for i, (job, label, curve, color) in enumerate(drawn):
        pts = " ".join(f"{sx(p.iteration):.1f},{sy(p.mean):.1f}" for p in curve)
        parts.append(f'<polyline class="series" data-job="{escape(job)}" stroke="{color}" points="{pts}"/>')
        for p in curve:
            tip = escape(f"{label}, iteration {p.iteration + 1}: mean {p.mean:.3f} ({p.episodes} episodes)")
            # an inline style: the console's ".chart .point" rule would override a fill attribute
            parts.append(
                f'<circle class="point" style="fill: {color}" cx="{sx(p.iteration):.1f}" cy="{sy(p.mean):.1f}" '
                f'r="3"><title>{tip}</title></circle>'
            )
        y = 12 + 16 * i
        parts.append(f'<rect x="{left}" y="{y - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(
            f'<text class="legend-label" x="{left + 16}" y="{y}">{escape(label)}<title>{escape(job)}</title></text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def metric_chart_svg(
    chart_id: str, label: str, points: Sequence[tuple[int, float]], *, width: int = 330, height: int = 170
) -> Markup:
    """One trainer figure per policy version (``points``: ``(version, value)``), drawn as a
    line with a point and tooltip per version; x ticks are versions (``v3``)."""
    if not points:
        return Markup(
            f'<svg id="{chart_id}" class="chart small empty" viewBox="0 0 {width} 60" role="img" '
            f'aria-label="{escape(label)}"><text x="12" y="34">No trained version yet.</text></svg>'
        )
    left, right, top, bottom = 52, 12, 22, 30
    w, h = width - left - right, height - top - bottom
    xs = [x for x, _ in points]
    lo, hi = min(y for _, y in points), max(y for _, y in points)
    if hi - lo < 1e-12:
        lo, hi = lo - (abs(lo) * 0.1 or 0.5), hi + (abs(hi) * 0.1 or 0.5)
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    x0, x1 = min(xs), max(xs)

    def sx(x: float) -> float:
        return left + (w / 2 if x1 == x0 else (x - x0) / (x1 - x0) * w)

    def sy(y: float) -> float:
        return top + h - (y - lo) / (hi - lo) * h

    parts = [
        f'<svg id="{chart_id}" class="chart small" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(label)} per policy version" data-points="{len(points)}">',
        f'<text class="axis" x="{left}" y="13">{escape(label)}</text>',
    ]
    for t in _ticks(lo, hi, 4):
        y = sy(t)
        parts.append(f'<line class="grid" x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for v in _x_ticks(x0, x1):
        parts.append(
            f'<text class="tick" x="{sx(v):.1f}" y="{top + h + 18}" text-anchor="middle">v{v}</text>'
        )
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline class="mean" points="{line}"/>')
    for x, y in points:
        tip = escape(f"v{x}: {label} {y:.4g}")
        parts.append(
            f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3"><title>{tip}</title></circle>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


# the trainer's figures the job page charts, in order: (field, label)
TRAINING_CHARTS = (
    ("loss", "loss"),
    ("kl", "KL"),
    ("grad_norm", "grad norm"),
    ("entropy", "entropy"),
    ("canary_mean", "logprob mismatch (canary, mean |Δ|)"),
)


def training_charts(versions: Sequence[Any]) -> list[Markup]:
    """The job page's charts of the trainer's numbers (``schemas.VersionTraining`` rows)."""
    return [
        metric_chart_svg(
            f"chart-{field.replace('_', '-')}",
            label,
            [(v.version, float(getattr(v, field))) for v in versions if getattr(v, field) is not None],
        )
        for field, label in TRAINING_CHARTS
    ]


def eval_curve_svg(points: Sequence[Any], *, width: int = 680, height: int = 260) -> Markup:
    """pass@k per policy version of the job's finished evaluations of one label (``points``:
    ``schemas.EvaluationPoint``), a line per k (:data:`PALETTE` in the order of k), on a 0..1
    axis; each point's tooltip has its mean reward and scored episodes."""
    done = [p for p in points if p.version is not None and p.state == "completed" and p.pass_at]
    labels = sorted({p.label for p in done})
    done = [p for p in done if labels and p.label == labels[0]]
    ks = sorted({k for p in done for k in p.pass_at}, key=int)
    if not done:
        return Markup(
            f'<svg id="eval-curve" class="chart empty" viewBox="0 0 {width} 80" role="img" '
            'aria-label="evaluation curve"><text x="12" y="44">No finished evaluation yet.</text></svg>'
        )
    left, right, top, bottom = 52, 16, 14 + 16 * len(ks), 34
    w, h = width - left - right, height - top - bottom
    x0, x1 = min(p.version for p in done), max(p.version for p in done)

    def sx(x: float) -> float:
        return left + (w / 2 if x1 == x0 else (x - x0) / (x1 - x0) * w)

    def sy(y: float) -> float:
        return top + h - y * h

    parts = [
        f'<svg id="eval-curve" class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="pass@k per policy version" data-points="{len(done)}" data-label="{escape(labels[0])}">'
    ]
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = sy(t)
        parts.append(f'<line class="grid" x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for v in _x_ticks(x0, x1):
        parts.append(
            f'<text class="tick" x="{sx(v):.1f}" y="{top + h + 18}" text-anchor="middle">v{v}</text>'
        )
    parts.append(
        f'<text class="axis" x="{left + w / 2:.1f}" y="{height - 2}" text-anchor="middle">policy version</text>'
    )
    for i, k in enumerate(ks):
        color = PALETTE[i % len(PALETTE)]
        have = sorted((p.version, p.pass_at[k], p) for p in done if p.pass_at.get(k) is not None)
        line = " ".join(f"{sx(v):.1f},{sy(y):.1f}" for v, y, _ in have)
        parts.append(f'<polyline class="series" data-k="{k}" stroke="{color}" points="{line}"/>')
        for v, y, p in have:
            reward = "–" if p.reward_mean is None else f"{p.reward_mean:.3f}"
            tip = escape(
                f"v{v}: pass@{k} {y:.3f} ({p.label}, {p.taskset}:{p.split}, mean reward {reward}, "
                f"{(p.summary or {}).get('episodes', 0)} episodes)"
            )
            parts.append(
                f'<circle class="point" style="fill: {color}" cx="{sx(v):.1f}" cy="{sy(y):.1f}" r="3">'
                f"<title>{tip}</title></circle>"
            )
        y = 12 + 16 * i
        parts.append(f'<rect x="{left}" y="{y - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text class="legend-label" x="{left + 16}" y="{y}">pass@{escape(k)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
