"""Two dispatcher replicas on one job, on the real stack: they share the result topics'
partitions (one consumer group), one of them leads the job's scheduling, and both handle
results. The job completes with each episode scored once and trained once, every command
on its topic exactly once, and each replica has handled results."""

from __future__ import annotations

import re

import httpx
import pytest

from temper.events import Topics
from tests.faults.harness import FaultStack, small_spec

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]

RESULT_TOPICS = (Topics.INFERENCE_RESULTS, Topics.REWARD_RESULTS)


def results_handled(stack: FaultStack, name: str) -> int:
    """Result messages the replica's consumer handled and committed (its /metrics)."""
    text = httpx.get(f"{stack.services[name].url}/metrics", timeout=5).text
    group = stack.group_env["TEMPER_DISPATCHER__RESULTS_GROUP"]
    total = 0.0
    for line in text.splitlines():
        if line.startswith("temper_bus_messages_consumed_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("group") == group and labels.get("topic") in RESULT_TOPICS:
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


@pytest.mark.timeout(300)
def test_two_dispatcher_replicas_share_one_job(fault_stack):
    stack: FaultStack = fault_stack(small_spec("replicas", **{"schedule.iterations": 4}))
    stack.start()
    stack.start_service("dispatcher-2", "dispatcher")
    stack.wait_healthy("dispatcher-2")
    stack.submit()
    facts = stack.assert_each_episode_scored_and_trained_once(stack.wait_job(200))
    for topic, counter in stack.commands().items():
        doubled = {k: n for k, n in counter.items() if n != 1}
        assert not doubled, f"{topic}: {len(doubled)} commands sent more than once"
    handled = {name: results_handled(stack, name) for name in ("dispatcher", "dispatcher-2")}
    print(f"\nREPLICAS results handled: {handled}, episodes {len(facts.episodes)}")  # noqa: T201
    assert all(n > 0 for n in handled.values()), f"a replica handled no result: {handled}"
    # every inference and reward result was handled by one of them (a redelivery may add)
    assert sum(handled.values()) >= 2 * len(facts.episodes), handled
