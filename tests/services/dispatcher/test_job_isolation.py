"""One bad job never stalls another: a job whose scheduling raises (its environment cannot
be built) is failed with the reason, and another tenant's valid job runs to the end."""

from __future__ import annotations

import pytest
from episode_peers import job_spec, job_state, seed, start_harness, submit_job, wait_for
from sqlalchemy import select

from temper.db import Job
from tests.plugindist import on_path, write_dist

pytestmark = pytest.mark.timeout(90)

# An environment plugin whose construction fails after the job was accepted.
UNBUILDABLE = """
from temper.envs import MathEnvironment

class Unbuildable(MathEnvironment):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("the math plugin lost its grader")
"""


async def _reason(db, job_id: str) -> str | None:
    async with db.session() as s:
        return await s.scalar(select(Job.state_reason).where(Job.id == job_id))


async def test_a_job_that_breaks_scheduling_fails_and_another_tenants_job_runs(tmp_path, database_url):
    site = tmp_path / "site"
    with on_path(site, "unbuildable"):
        write_dist(site, "unbuildable", {"unbuildable": UNBUILDABLE},
                   {"temper.environments": {"unbuildable": "unbuildable:Unbuildable"}})  # fmt: skip
        await _run(tmp_path, database_url)


async def _run(tmp_path, database_url) -> None:
    h = await start_harness(tmp_path, database_url)
    try:
        await seed(h.db, tenant="acme", taskset="ts1")
        await seed(h.db, tenant="beta", taskset="ts2", tasks={"b1": {}, "b2": {}})
        # stored before the door checked kinds (or by an older dispatcher): not a kind we run
        browser = job_spec(name="browser-job", environment__kind="browser")
        math = job_spec(name="math-job", environment__kind="unbuildable")
        bad = [await submit_job(h.db, browser, tenant="acme"), await submit_job(h.db, math, tenant="acme")]
        good = await submit_job(h.db, job_spec(name="good", tasks__taskset="ts2"), tenant="beta")

        async def done() -> bool:
            return await job_state(h.db, good) == "completed"

        await wait_for(done, limit_s=40, what="the other tenant's job completes")
        assert [await job_state(h.db, j) for j in bad] == ["failed", "failed"]
        browser_reason, math_reason = [await _reason(h.db, j) for j in bad]
        assert browser_reason and "browser" in browser_reason, browser_reason
        assert math_reason and "lost its grader" in math_reason, math_reason
    finally:
        await h.stop()
