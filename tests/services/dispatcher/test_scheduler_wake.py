"""The scheduler runs when work calls for it, not only on its interval: when an episode
finishes (its slot is free) and when a pass stopped at MAX_STARTS_PER_PASS with more to
start. The interval here is 60 s, so a job that gets going and completes within the test's
limits shows both wakes (SQLite, and Postgres under the ``postgres`` marker)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest
from episode_peers import FENCE, episodes_of, job_spec, job_state, seed, start_harness, submit_job, wait_for

from services.dispatcher import scheduler
from temper.db import Database
from temper.db.migrate import upgrade
from temper.events import InferenceRequest
from temper.settings import DatabaseSettings

pytestmark = pytest.mark.timeout(120)


def one_turn(req: InferenceRequest) -> str:
    return f"{FENCE}python add.py\ndef add(a, b):\n    return a + b\n{FENCE}\nsubmit"


async def test_the_scheduler_is_woken_by_a_capped_pass_and_by_finished_episodes(
    tmp_path, database_url, monkeypatch
):
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    name = f"wake-{uuid.uuid4().hex[:8]}"
    await seed(db, tenant=name, taskset=f"ts-{name}", tasks={f"{name}-t{i}": {} for i in range(3)})
    job = await submit_job(
        db,
        job_spec(
            tasks__taskset=f"ts-{name}",
            tasks__group_size=1,
            schedule__episodes_per_iteration=6,
            schedule__max_concurrent_episodes=3,
        ),
        tenant=name,
    )
    await db.dispose()
    # one episode a pass: the three that fit take three passes, each woken by the last
    monkeypatch.setattr(scheduler, "MAX_STARTS_PER_PASS", 1)
    h = await start_harness(
        tmp_path, database_url, migrate=False, scheduler_interval_s=60.0, peers={"script": one_turn}
    )
    try:
        h.peers.hold = True  # the started episodes wait on their model: none finishes yet

        async def three_started() -> bool:
            return len(await episodes_of(h.db, job)) == 3

        await wait_for(three_started, limit_s=20, what="three episodes started, one pass each")
        await asyncio.sleep(0.5)
        assert len(await episodes_of(h.db, job)) == 3, "max_concurrent_episodes still holds"
        await h.peers.release()

        async def completed() -> bool:
            return await job_state(h.db, job) == "completed"

        # the other three start as the first ones finish, well before the 60 s interval
        await wait_for(completed, limit_s=40, what="the job completed")
        assert Counter(e.state for e in await episodes_of(h.db, job)) == {"scored": 6}
    finally:
        await h.stop()


async def test_the_scheduler_is_woken_when_this_processs_gateway_serves_a_new_version(
    tmp_path, database_url, monkeypatch
):
    """The staleness gate opens an iteration on the version the gateway serves; in one
    process the gateway says so through ``Runtime.version_served`` and the scheduler runs
    then, not at its next interval (60 s here). The dispatcher takes its wake (and its
    relay's notify, ``Runtime.outbox_relays``) back when it stops."""
    ticks: list[float] = []
    tick = scheduler.Scheduler.tick

    async def counted(self) -> None:  # type: ignore[no-untyped-def]
        ticks.append(asyncio.get_running_loop().time())
        await tick(self)

    monkeypatch.setattr(scheduler.Scheduler, "tick", counted)
    h = await start_harness(tmp_path, database_url, scheduler_interval_s=60.0)
    try:
        # its wake and its outbox relay's, for the services beside it in this process
        assert len(h.runtime.version_served) == 1 and len(h.runtime.outbox_relays) == 1

        async def first_pass() -> bool:
            return len(ticks) >= 1

        await wait_for(first_pass, limit_s=20, what="the scheduler's first pass")
        await asyncio.sleep(0.5)
        before = len(ticks)
        h.runtime.notify_version_served()

        async def woken() -> bool:
            return len(ticks) > before

        await wait_for(woken, limit_s=20, what="a pass after the served version")
    finally:
        await h.stop()
    assert h.runtime.version_served == [] and h.runtime.outbox_relays == []
