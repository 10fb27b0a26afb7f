"""The reduced chaos set (``make chaos`` runs them all, bench/chaos.py): one group of the
chaos workload (two LoRA jobs and a full-weight job at once on one base model, two CPU
engines, multi-turn sandbox episodes scored by hidden tests) broken five times: three
services killed while they hold work at a fault point (a sandbox worker after running an
agent's action, the gateway with a policy version about to be loaded, the reward scorer
with a score not yet recorded), the group's Postgres restarted mid-iteration, and the
object store refusing every request for 20 s from a publish on. The jobs complete with every episode scored once and
trained once, nothing trained twice, every outbox row on its topic, and the content
checks find nothing: every tagged version is the job's, every recomputed logprob agrees
with its version's weights, every re-score agrees, every sandbox turn ran in the
workspace of the snapshot it continued from (sessions of the killed worker included).
Each recovery (to the first correct progress) is printed (``-s`` shows it)."""

from __future__ import annotations

import pytest

from tests.faults.chaos import Chaos

# Back in `make test` on 2026-12-05: its two stopped jobs (1 run in 2, then 1 in 12, then 1 in
# 13) were the gateway dropping a version it failed to load while the object store refused
# (the job's next iteration waited on that version for good); it is now tried again.
pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_three_jobs_survive_kills_in_flight_with_what_they_trained_intact(tmp_path, kafka_bootstrap):
    chaos = Chaos(tmp_path, step_timeout_s=150, private_kafka=False, rescore=4)
    try:
        chaos.submit("reduced", iterations=5)
        recoveries = {
            "kill sandbox_worker @ action": chaos.kill_at("sandbox_worker", "action", gather_s=1.0),
            "kill inference_gateway @ adapter load": chaos.kill_at("inference_gateway", "adapter load"),
            "kill reward_scorer @ score": chaos.kill_at("reward_scorer", "score"),
            "restart postgres": chaos.restart_postgres(),
            "object store refuses 20 s": chaos.refuse_object_store(20.0),
        }
        check = chaos.check_job()
        dead = chaos.stack.dead_letters(list(chaos.jobs))
    finally:
        chaos.close()
    for what, r in recoveries.items():
        print(f"\nRECOVERY {what}: {r.seconds:.1f}s, {r.in_flight} in flight at the kill ({r.what})")  # noqa: T201
    print(f"\n{check.summary}")  # noqa: T201
    assert check.ok, check.problems
    assert (check.episodes_lost, check.double_scored, check.double_trained, check.outbox_lost) == (0, 0, 0, 0)
    assert not dead, dead
    assert all(r.in_flight > 0 for r in recoveries.values()), recoveries
    content = check.content
    # the checks looked at something: every job's published versions, re-scores, sandbox turns,
    # and sessions of the killed worker that went on in the new one
    for job_id in chaos.jobs:
        assert any(v >= 1 for j, v in content.samples_checked if j == job_id), content.samples_checked
    assert content.rescored == 4 * len(chaos.jobs)
    assert content.turns_checked > 0 and content.sessions_moved > 0, content.summary()
