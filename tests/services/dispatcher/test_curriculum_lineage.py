"""The curriculum reads the job's own pass rates, and a prior job's when the spec names
it (``tasks.prior_from_job``): outcomes of other jobs on the set do not steer it."""

from __future__ import annotations

from collections import Counter

import pytest
from episode_peers import episodes_of, job_spec, seed, start_harness, submit_job, wait_for

pytestmark = pytest.mark.timeout(60)


async def sampled(h, past: str | None) -> Counter[str]:
    spec = job_spec(
        tasks__group_size=1, tasks__seed=3, tasks__prior_from_job=past,
        schedule__episodes_per_iteration=16, schedule__max_concurrent_episodes=16,
    )  # fmt: skip
    job = await submit_job(h.db, spec)

    async def started() -> bool:
        return len(await episodes_of(h.db, job)) == 16

    await wait_for(started, what="16 episodes started")
    return Counter(e.task_id for e in await episodes_of(h.db, job))


async def test_a_job_starts_from_its_prior_jobs_pass_rates_only_when_asked(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"hold": True})
    try:
        # a finished job solved "solved" every time and "learnable" 4 times in 10
        past = await seed(
            h.db, tasks={"solved": {"attempts": 10, "passes": 10}, "learnable": {"attempts": 10, "passes": 4}}
        )
        with_prior = await sampled(h, past)
        fresh = await sampled(h, None)
    finally:
        h.peers.hold = False
        await h.stop()
    # with the prior, the settled task weighs 0.05 against 1; without it both are unmeasured
    assert with_prior["solved"] <= 2 and with_prior["learnable"] >= 14, with_prior
    assert fresh["solved"] >= 5, fresh
