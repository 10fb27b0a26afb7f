"""Recovery on the real stack: each service its own process, one part broken mid-job
(tests/faults/harness.py). In every test the job completes with each episode scored once
and trained once; each test prints its recovery time (``-s`` shows it)."""

from __future__ import annotations

import pytest

from tests.faults.harness import FaultStack


def report(what: str, seconds: float) -> None:
    print(f"\nRECOVERY {what}: {seconds:.1f}s")  # noqa: T201 - the figure the test exists to measure


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.timeout(240)
def test_each_command_reaches_kafka_exactly_once(fault_stack):
    """The dispatcher's fast path and the trainer's relay share the outbox: each command is
    relayed by one of them, so every topic holds each command once."""
    stack: FaultStack = fault_stack()
    stack.start()
    stack.submit()
    facts = stack.assert_each_episode_scored_and_trained_once(stack.wait_job(150))
    counts = stack.commands()
    episodes = {e.id for e in facts.episodes}
    for topic, counter in counts.items():
        doubled = {k: n for k, n in counter.items() if n != 1}
        assert not doubled, (
            f"{topic}: {len(doubled)} commands sent more than once, e.g. {list(doubled.items())[:3]}"
        )
    assert {k[0] for k in counts["inference.requests"]} == episodes
    assert {k[0] for k in counts["reward.requests"]} == episodes
    assert {k[0] for k in counts["trajectories"]} == episodes
