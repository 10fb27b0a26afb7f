"""A failed or cancelled job can be resumed (``POST /v1/jobs/{id}/resume``, ``temper
resume JOB``, the console's Resume button): the same job runs again through
temper.lifecycle's table, keeping its iteration, policy version and finished episodes."""

from __future__ import annotations

import httpx
import pytest

from temper.db import Database, Job
from temper.lifecycle import IllegalTransition, JobState, transition_job

pytestmark = pytest.mark.timeout(60)


async def test_a_cancelled_job_resumes_where_it_was(client, env, seeded):
    job_id = seeded.running_job_id
    before = (await client.get(f"/v1/jobs/{job_id}")).json()
    episodes_before = (await client.get(f"/v1/jobs/{job_id}/episodes", params={"limit": 500})).json()["items"]
    r = await client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled" and r.json()["finished_at"]
    r = await client.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["state"] == "running" and job["finished_at"] is None
    assert job["iteration"] == before["iteration"] and job["policy_version"] == before["policy_version"]
    after = {
        e["id"]: e
        for e in (await client.get(f"/v1/jobs/{job_id}/episodes", params={"limit": 500})).json()["items"]
    }
    for e in episodes_before:
        if e["state"] in ("scored", "trained"):
            assert after[e["id"]]["state"] == e["state"]  # finished work still counts
        elif e["state"] not in ("failed", "cancelled"):
            assert after[e["id"]]["state"] == "cancelled"  # what was in flight stays ended
    # a completed job has nothing to resume
    r = await client.post(f"/v1/jobs/{seeded.job_id}/resume")
    assert r.status_code == 409


async def test_a_failed_job_resumes_and_a_completed_one_does_not(env):
    settings, seeded = env
    db = Database(settings.db)
    try:
        async with db.session() as s:
            job = await s.get(Job, seeded.running_job_id)
            await transition_job(s, job, JobState.failed, reason="trainer gave up")
            await transition_job(s, job, JobState.running, reason="resumed")
            assert job.state == JobState.running and job.finished_at is None
            done = await s.get(Job, seeded.job_id)
            with pytest.raises(IllegalTransition, match="completed -> running is not allowed"):
                await transition_job(s, done, JobState.running)
    finally:
        await db.dispose()


async def test_the_console_offers_resume_on_a_cancelled_job(app, client, seeded):
    await client.post(f"/v1/jobs/{seeded.running_job_id}/cancel")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dispatcher") as browser:
        await browser.post("/console/login", data={"key": seeded.key, "next": "/console/"})
        page = (await browser.get(f"/console/jobs/{seeded.running_job_id}")).text
        assert 'id="resume-job"' in page
        r = await browser.post(f"/console/jobs/{seeded.running_job_id}/resume")
        assert r.status_code == 303
        assert (
            'id="job-state" class="state s-running"'
            in (await browser.get(f"/console/jobs/{seeded.running_job_id}")).text
        )
