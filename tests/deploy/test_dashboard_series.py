"""Every metric a Grafana panel queries (deploy/grafana/dashboards/temper.json) is exported
with a sample by some Temper service, without Docker: each service's metric set-up runs in a
fresh interpreter (its own default registry, as in its container) and its /metrics text is
parsed. What a service does at start runs as at start; what it does on taking a job, on
subscribing to a topic and after one optimizer step runs as it would then. A panel on a metric
no service exports (or exports only once a fault happens) fails here before `make compose-test`
would show it empty."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)  # imports take seconds alone, minutes on a loaded box
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "temper.json"
JOB = "job-dashboard-test"

# Each service's set-up, run in its own interpreter; the bus part is a real subscription on
# the in-process bus (the Kafka consumer builds the same Delivery).
SUBSCRIBE = """
import asyncio
from temper.bus.inprocess import InProcessBus

async def subscribe(topics, group):
    bus = InProcessBus()
    await bus.create_topics(topics)
    async def handler(record): pass
    consumer = await bus.subscribe(topics, group, handler)
    await consumer.stop()
"""
SERVICES = {
    "dispatcher": """
from services.dispatcher import episodes, scheduler
from temper.events import Topics
episodes.init_metrics()                 # EpisodeMachine() at start
scheduler.init_job_metrics(JOB)         # a job started
asyncio.run(subscribe([Topics.INFERENCE_RESULTS, Topics.SANDBOX_RESULTS, Topics.REWARD_RESULTS], "dispatcher"))
""",
    "inference-gateway": """
from services.inference_gateway.router import backend_metrics
from temper.events import Topics
backend_metrics("cpu")                  # a backend's Slot at start
asyncio.run(subscribe([Topics.INFERENCE_REQUESTS], "inference-gateway"))
""",
    "sandbox-worker": """
from temper.events import Topics
from temper.sandbox import SandboxManager
from temper.settings import SandboxSettings
SandboxManager(SandboxSettings())       # at start
asyncio.run(subscribe([Topics.SANDBOX_REQUESTS], "sandbox-worker"))
""",
    "reward-scorer": """
from services.reward_scorer.scoring import init_metrics
from temper.events import Topics
from temper.sandbox import SandboxManager
from temper.settings import SandboxSettings
init_metrics()                          # SubmissionScorer() at start
SandboxManager(SandboxSettings())
asyncio.run(subscribe([Topics.REWARD_REQUESTS], "reward-scorer"))
""",
    "trainer": """
from types import SimpleNamespace
from services.trainer.observe import init_job_metrics, observe_step
from temper.events import Topics
init_job_metrics(JOB, 0)                # a job's learner loaded
# its first step (the StepStats fields observe_step reads; the real class needs torch)
observe_step(JOB, SimpleNamespace(
    loss=0.5, reward_mean=0.5, reward_std=0.1, kl=0.0, clip_fraction=0.0, tokens_per_s=9.0, staleness=[0],
    token_staleness_mean=0.0, token_staleness_max=0, multi_version_share=0.0,
))
asyncio.run(subscribe([Topics.TRAJECTORIES], "trainer"))
""",
}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip


def panel_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a function (a
    name followed by "("), a keyword, a label (inside {} or a by/without list) or a duration."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = {
        m.group()
        for m in re.finditer(r"(?<![\w$.])[a-zA-Z_:][\w:]*", expr)
        if not expr[m.end() :].lstrip().startswith("(")
    }
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def panels() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"]) for p in doc["panels"] if p.get("type") != "row" for t in p.get("targets", [])
    ]


def exported() -> dict[str, dict[str, int]]:
    """Per service: sample name -> samples in its /metrics text after its set-up. The services'
    interpreters run at once (most of their time is imports)."""
    procs = {}
    for service, setup in SERVICES.items():
        code = f"JOB = {JOB!r}\n" + SUBSCRIBE + textwrap.dedent(setup)
        code += "\nfrom temper.metrics import render_latest\nprint(render_latest()[0].decode())\n"
        procs[service] = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={"PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}", "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    by_service: dict[str, dict[str, int]] = {}
    for service, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{service}'s metric set-up failed:\n{stderr[-3000:]}"
        counts = by_service[service] = {}
        for family in text_string_to_metric_families(stdout):
            for sample in family.samples:
                counts[sample.name] = counts.get(sample.name, 0) + 1
    return by_service


def test_panel_metrics_parse() -> None:
    # The parser's own check: functions, keywords, labels, ranges and $variables are not metrics.
    expr = (
        'histogram_quantile(0.95, sum by (le, kind) (rate(temper_turn_seconds_bucket{job=~"$job"}'
        "[$__rate_interval]))) / ignoring(x) up + sum(rate(b_total[5m] offset 1m))"
    )
    assert panel_metrics(expr) == {"temper_turn_seconds_bucket", "up", "b_total"}
    assert all(panel_metrics(expr) for _, expr in panels())


def test_every_panel_metric_is_exported() -> None:
    by_service = exported()
    missing = []
    for title, expr in panels():
        for name in sorted(panel_metrics(expr)):
            if not any(counts.get(name) for counts in by_service.values()):
                missing.append(f"{title!r}: {name} ({expr})")
    assert not missing, "panel metrics no service exports with a sample:\n" + "\n".join(missing)
