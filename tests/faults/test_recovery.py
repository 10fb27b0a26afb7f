"""Recovery on the real stack: each service its own process, one part broken mid-job
(tests/faults/harness.py). In every test the job completes with each episode scored once
and trained once; each test prints its recovery time (``-s`` shows it)."""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime

import pytest

from tests.faults.harness import FaultStack, Tripwire, small_spec, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]


def report(what: str, seconds: float) -> None:
    print(f"\nRECOVERY {what}: {seconds:.1f}s")  # noqa: T201 - the figure the test exists to measure


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


@pytest.mark.long  # the reduced chaos set kills the gateway, restarts Postgres, refuses S3
@pytest.mark.timeout(300)
def test_a_gateway_killed_mid_job_comes_back_on_the_current_policy_version(fault_stack):
    """SIGKILL the gateway once the trainer has published a version: the new process loads
    the job's current version from the database before it answers a request, so none of its
    results carries an older version (its policy group, set to the topic's end, would
    otherwise leave it on version 0)."""
    episodes = 4 * 8  # small_spec's episodes_per_iteration, over the iterations below
    stack: FaultStack = fault_stack(small_spec("gateway-killed", **{"schedule.iterations": 4}))
    stack.start()
    stack.submit()
    # Freeze the gateway (SIGSTOP) while answers are still owed, so the new process is the one
    # that gives them: tiny-model answers are too quick to catch in flight any other way.
    stack.wait(
        "policy version 1 with answers still owed",
        lambda: (f := stack.facts()).job.policy_version >= 1 and len(f.inference) < episodes,
        120,
        every_s=0.1,
    )
    stack.kill("inference_gateway", signal.SIGSTOP, wait=False)
    frozen = datetime.now(UTC)  # the old process answers nothing after this
    current = stack.facts().job.policy_version
    killed = time.monotonic()
    stack.kill("inference_gateway")
    stack.start_service("inference_gateway")
    stack.wait_healthy("inference_gateway")

    def answered_by_the_new_process(f):
        # The answer's own time, not the dispatcher's: the old process's last answers may
        # still be on the bus when the dispatcher completes them.
        return [s for s in f.inference if datetime.fromisoformat(s.result["answered_at"]) > frozen]

    stack.wait("a result from the restarted gateway", lambda: answered_by_the_new_process(stack.facts()), 90)
    report("gateway SIGKILL -> first result from the new process", time.monotonic() - killed)
    facts = stack.assert_each_episode_scored_and_trained_once(stack.wait_job(150))
    versions = sorted({s.result["policy_version"] for s in answered_by_the_new_process(facts)})
    assert versions[0] >= current, (
        f"results of the restarted gateway carry {versions}, the job was at v{current}"
    )
    assert "policy version loaded at start" in stack.services["inference_gateway"].tail(200_000)
    assert not stack.dead_letters()


@pytest.mark.timeout(300)
def test_a_dead_lettered_trajectory_is_sent_again_and_the_job_completes(fault_stack):
    """The trainer's trajectories are dead-lettered (moved to ``trajectories.dlq``, its group
    committed past them, as the bus does with a poison message) while it is down: the
    dispatcher's trajectory lease sends them again, and the job completes."""
    stack: FaultStack = fault_stack(env_overrides={"TEMPER_DISPATCHER__TRAJECTORY_LEASE_S": "3"})
    stack.start([n for n in stack.SERVICE_NAMES if n != "trainer"])
    stack.submit()
    wait_until(
        "two iterations scored", lambda: sum(e.state == "scored" for e in stack.facts().episodes) >= 16, 120
    )
    moved = stack.dead_letter_waiting("TEMPER_TRAINER__GROUP", "trajectories")
    assert moved >= 16
    started = time.monotonic()
    stack.start(["trainer"])
    wait_until("the dead-lettered trajectories in the ledger", lambda: len(stack.facts().ledger) >= 16, 60)
    report("dead-lettered trajectories -> all in the trainer's ledger", time.monotonic() - started)
    stack.assert_each_episode_scored_and_trained_once(stack.wait_job(120))
    assert stack.dead_letters()["trajectories.dlq"] == moved


@pytest.mark.long  # the reduced chaos set kills the gateway, restarts Postgres, refuses S3
@pytest.mark.timeout(300)
def test_a_postgres_restart_under_load_costs_seconds_and_dead_letters_nothing(fault_stack, private_postgres):
    """Restart the job's Postgres (a private cluster) while episodes are in flight: the
    consumers wait for the database instead of dead-lettering the results they hold, so
    nothing waits for a 300 s lease and the job completes."""
    episodes = 4 * 8  # small_spec's episodes_per_iteration, over the iterations below
    stack: FaultStack = fault_stack(
        small_spec("postgres-restart", **{"schedule.iterations": 4}), db_url=private_postgres.url
    )
    stack.start()
    stack.submit()
    # At least an iteration still to score: the fourth cannot start before version 2.
    stack.wait(
        "a first version with an iteration still to score",
        lambda: (
            (f := stack.facts()).job.policy_version >= 1
            and episodes - sum(e.state in ("scored", "trained") for e in f.episodes) >= 8
        ),
        120,
        every_s=0.1,
    )
    # Down for longer than the bus's quick retries (0.2 + 0.4 + 0.6 s), as a failover is.
    down_s = private_postgres.restart(down_s=3.0)
    back = datetime.now(UTC)
    restarted = time.monotonic()

    def scored_after_restart():
        f = stack.facts()
        return any(
            e.updated_at and e.state in ("scored", "trained") and e.updated_at > back for e in f.episodes
        )

    wait_until("an episode scored after the restart", scored_after_restart, 90)
    report(f"Postgres restart ({down_s:.1f}s down) -> first episode scored", time.monotonic() - restarted)
    stack.assert_each_episode_scored_and_trained_once(stack.wait_job(120))
    assert not stack.dead_letters(), stack.dead_letters()
    for name in stack.services:
        assert stack.health(name) == 200, name


@pytest.mark.long  # the reduced chaos set kills the gateway, restarts Postgres, refuses S3
@pytest.mark.timeout(300)
def test_an_object_store_outage_during_the_last_checkpoint_is_retried_and_visible(fault_stack, private_minio):
    """Stop the job's object store (a private MinIO) the moment the trainer uploads the
    last checkpoint. No new step will come to retry it, so the trainer retries the publish
    on its own; meanwhile its /health is 503 and the job says it is stuck, and once the
    store is back the version is published and the job completes."""
    outage_s = 10.0
    restored: list[float] = []

    def outage() -> None:
        private_minio.stop()

        def restore() -> None:
            private_minio.start()
            restored.append(time.monotonic())

        threading.Timer(outage_s, restore).start()

    last = 3  # small_spec's iterations: one version each
    tripwire = Tripwire(private_minio.port, rb"PUT /[^ ]*/versions/v%d/" % last, outage)
    tripwire.armed = True
    try:
        stack: FaultStack = fault_stack(
            storage={**private_minio.settings(), "TEMPER_STORAGE__ENDPOINT": tripwire.endpoint}
        )
        stack.start()
        stack.submit()
        assert stack.spec["schedule"]["iterations"] == last
        stack.wait("the last checkpoint upload", lambda: tripwire.tripped_at is not None, 120)
        seen = {"health": set(), "reason": set()}

        def watch() -> bool:
            seen["health"].add(stack.health("trainer"))
            f = stack.facts()
            seen["reason"].add(f.job.state_reason)
            return bool(restored) and last in f.versions

        stack.wait(f"version {last} published after the outage", watch, 120, every_s=0.5)
        report("object store back -> last version published", time.monotonic() - restored[0])
        assert 503 in seen["health"], (
            f"the trainer's /health answered {seen['health']} while it could not publish"
        )
        assert any(r and r.startswith("stuck: trainer cannot publish") for r in seen["reason"]), seen[
            "reason"
        ]
        facts = stack.assert_each_episode_scored_and_trained_once(stack.wait_job(60))
        assert facts.versions == list(range(1, last + 1))
        assert facts.job.state_reason is None, "the stuck reason is cleared once published"
        assert stack.health("trainer") == 200
    finally:
        tripwire.close()
