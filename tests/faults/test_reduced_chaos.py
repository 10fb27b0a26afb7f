"""The reduced chaos set (``make chaos`` runs them all, bench/chaos.py): one job broken
four times in sequence — the reward scorer and the inference gateway SIGKILLed and
restarted mid-iteration, the job's Postgres restarted, the object store refusing every
request for 20 s from the moment the trainer publishes a version. The job completes with
every episode scored once and trained once, no trajectory trained twice and every outbox
row on its topic; each recovery is printed (``-s`` shows it)."""

from __future__ import annotations

import pytest

from tests.faults.chaos import Chaos

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_one_job_survives_four_faults_in_sequence(tmp_path, kafka_bootstrap):
    chaos = Chaos(tmp_path, step_timeout_s=150, private_kafka=False)
    try:
        chaos.submit("reduced", iterations=6)
        recoveries = {
            "kill reward_scorer @ mid-iteration": chaos.kill_and_restart("reward_scorer", "mid-iteration"),
            "kill inference_gateway @ mid-iteration": chaos.kill_and_restart(
                "inference_gateway", "mid-iteration"
            ),
            "restart postgres": chaos.restart_postgres(),
            "object store refuses 20 s": chaos.refuse_object_store(20.0),
        }
        check = chaos.check_job()
    finally:
        chaos.close()
    for what, seconds in recoveries.items():
        print(f"\nRECOVERY {what}: {seconds:.1f}s")  # noqa: T201 - the figures the test measures
    print(f"\n{check.summary}")  # noqa: T201
    assert check.ok, check.problems
    assert (check.episodes_lost, check.double_scored, check.double_trained, check.outbox_lost) == (0, 0, 0, 0)
    assert not chaos.stack.dead_letters(), chaos.stack.dead_letters()
