"""Dynamic sampling on the real stack (each service its own process, tests/faults/harness.py):
the tiny random policy solves no arithmetic task, so every group has zero reward variance;
the real trainer skips each one, the dispatcher starts replacements up to
``algorithm.max_replacement_groups`` an iteration, and the job completes with the counts."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from tests.faults.harness import FaultStack, small_spec

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_flat_groups_are_replaced_up_to_the_bound_and_the_job_completes(fault_stack):
    spec = small_spec(
        "dynamic-sampling",
        **{
            "algorithm.skip_zero_variance": True,
            "algorithm.dynamic_sampling": True,
            "algorithm.max_replacement_groups": 1,
            "schedule.iterations": 2,
            "schedule.episodes_per_iteration": 4,  # one group of 4 an iteration
            "schedule.max_concurrent_episodes": 4,
            "algorithm.groups_per_step": 1,
        },
    )
    stack: FaultStack = fault_stack(spec)
    stack.start()
    stack.submit()
    facts = stack.wait_job(120)
    assert facts.job.state == "completed", stack.logs()
    assert stack.api is not None
    sampling = stack.api._call("GET", f"/v1/jobs/{stack.job_id}/metrics")["sampling"]

    groups: dict[str, list] = defaultdict(list)
    for e in facts.episodes:
        groups[e.group_id].append(e)
    flat = {g for g, eps in groups.items() if len({e.reward for e in eps}) == 1}
    # the real trainer skipped every flat group for zero variance and trained only groups with signal
    for g, eps in groups.items():
        rows = [facts.ledger[e.id] for e in eps if e.id in facts.ledger]
        if g in flat:
            assert rows and all(r.skipped == "zero_reward_variance" for r in rows), g
        else:
            assert all(r.skipped is None for r in rows), g
    # replacements: one per skip, at most one an iteration; both iterations ran their own 4
    per_iteration = Counter(e.iteration for e in facts.episodes)
    assert set(per_iteration) == {0, 1} and min(per_iteration.values()) >= 4, per_iteration
    replaced = {it: (n - 4) // 4 for it, n in per_iteration.items()}
    assert all(r <= 1 for r in replaced.values()), replaced
    assert sampling["zero_variance_groups"] == len(flat)
    assert sampling["replacement_groups"] == sum(replaced.values()) >= 1
    assert sampling["unreplaced_groups"] == len(flat) - sampling["replacement_groups"]
    if sampling["unreplaced_groups"]:  # the job ended with skips left: the last iteration used its bound
        assert replaced[1] == 1
