"""A job none of whose episodes could be scored has nothing to learn from: it ends
``failed`` with the reasons its episodes failed (and their counts), not ``completed``
(SQLite, and Postgres under the ``postgres`` marker)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from episode_peers import episodes_of, job_spec, job_state, seed, start_harness, submit_job, wait_for

from temper.db import Database, Job
from temper.db.migrate import upgrade
from temper.events import RewardRequest, RewardResult
from temper.settings import DatabaseSettings

pytestmark = pytest.mark.timeout(120)


async def test_a_job_whose_every_episode_failed_fails_saying_why(tmp_path, database_url):
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    name = f"allfail-{uuid.uuid4().hex[:8]}"
    await seed(db, tenant=name, taskset=f"ts-{name}", tasks={f"{name}-t{i}": {} for i in range(2)})
    job = await submit_job(
        db,
        job_spec(tasks__taskset=f"ts-{name}", tasks__group_size=1, schedule__episodes_per_iteration=2),
        tenant=name,
    )
    await db.dispose()
    h = await start_harness(tmp_path, database_url, migrate=False)
    answer = h.peers.reply

    def grader_crashes(msg):  # every reward request answered with the grader's error
        if isinstance(msg, RewardRequest):
            return RewardResult(job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt,
                                task_id=msg.task_id, reward=0.0, error="the grader crashed")  # fmt: skip
        return answer(msg)

    h.peers.reply = grader_crashes  # type: ignore[method-assign]
    try:

        async def ended() -> bool:
            return await job_state(h.db, job) in ("completed", "failed")

        await wait_for(ended, limit_s=60, what="the job ended")
        assert [e.state for e in await episodes_of(h.db, job)] == ["failed", "failed"]
        async with h.db.session() as s:
            row = await s.get(Job, job)
            assert row.state == "failed", row.state_reason
            assert (
                row.state_reason
                == "every episode failed (2): 2 x reward_error: the grader crashed (after 3 attempts)"
            ), row.state_reason
    finally:
        await h.stop()
