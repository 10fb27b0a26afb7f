from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from temper.bus import InProcessBus, KafkaBus
from temper.events import LifecycleEvent, Topics

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "analytics_consumer", ROOT / "examples" / "analytics_consumer.py"
)
assert spec and spec.loader
analytics = importlib.util.module_from_spec(spec)
sys.modules["analytics_consumer"] = analytics
spec.loader.exec_module(analytics)

pytestmark = pytest.mark.timeout(60)


def events(job: str) -> list[LifecycleEvent]:
    out = [LifecycleEvent(event="job.state", job_id=job, state="running")]
    for i, (iteration, reward) in enumerate([(0, 0.0), (0, 1.0), (1, 1.0), (1, 1.0)]):
        ep = f"{job}-e{i}"
        out += [
            LifecycleEvent(event="episode.state", job_id=job, episode_id=ep, state="awaiting_action"),
            LifecycleEvent(event="episode.state", job_id=job, episode_id=ep, state="scoring"),
            LifecycleEvent(event="episode.state", job_id=job, episode_id=ep, state="scored", reward=reward),
            LifecycleEvent(
                event="episode.reward",
                job_id=job,
                episode_id=ep,
                reward=reward,
                data={"iteration": iteration},
            ),
        ]
    out += [
        LifecycleEvent(event="episode.state", job_id=job, episode_id=f"{job}-e9", state="failed", reason="x"),
        LifecycleEvent(event="policy.version", job_id=job, version=2),
        LifecycleEvent(event="job.state", job_id=job, state="completed"),
    ]
    return out


def check(summary: dict, job: str) -> None:
    assert summary[job] == {
        "state": "completed",
        "policy_version": 2,
        "episodes": {"scored": 4, "failed": 1},
        "mean_reward": {0: 0.5, 1: 1.0},
    }


async def feed(bus, job: str, group: str):
    agg = analytics.Aggregates()
    await bus.create_topics([Topics.EVENTS])
    consumer = await bus.subscribe([Topics.EVENTS], group, agg.handle)
    evs = events(job)
    for ev in evs + evs[3:8]:  # at-least-once: part of it arrives twice, stale states included
        await bus.send_message(Topics.EVENTS, ev)
    await bus.send(Topics.EVENTS, b'{"type": "lifecycle", "schema_version": 99}', key=job)
    for _ in range(300):
        # Partitions are consumed independently: wait for all of them, not just the last event.
        if agg.skipped and agg.summary().get(job, {}).get("episodes") == {"scored": 4, "failed": 1}:
            break
        await asyncio.sleep(0.05)
    await consumer.stop()
    return agg


async def test_aggregates_on_the_in_process_bus():
    agg = await feed(InProcessBus(partitions=3), "job-a", "analytics")
    check(agg.summary(), "job-a")
    assert agg.skipped == 1


@pytest.mark.kafka
async def test_aggregates_on_kafka(kafka_bootstrap, unique):
    sys.path.insert(0, str(ROOT / "tests" / "services" / "dispatcher"))
    from temper.bus.kafka import start_groups_at_end

    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=3)
    await bus.start()
    await bus.create_topics([Topics.EVENTS])
    await start_groups_at_end(kafka_bootstrap, {f"analytics-{unique}": [Topics.EVENTS]})
    try:
        agg = await feed(bus, f"job-{unique}", f"analytics-{unique}")
    finally:
        await bus.stop()
    check(agg.summary(), f"job-{unique}")
