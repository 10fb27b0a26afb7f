"""Tenants share a contended fleet by weight, and a tenant over a quota is paused with the
quota as its reason (not failed), and goes on when an admin raises the quota.

Both run the whole dispatcher (scheduler, result handlers, outbox) against fake peers, on
SQLite and on the real Postgres."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter

import httpx
import pytest
from episode_peers import (
    FENCE,
    episodes_of,
    job_spec,
    job_state,
    seed,
    settings_for,
    start_harness,
    submit_job,
    wait_for,
)
from sqlalchemy import func, select, update

from services.dispatcher.app import create_app
from services.dispatcher.fairshare import Usage, tenant_usage
from services.dispatcher.scheduler import Scheduler
from temper.db import Database, Episode, Job, PolicyVersion, Step, Tenant
from temper.db.migrate import upgrade
from temper.events import InferenceRequest
from temper.settings import DatabaseSettings
from temper.tenants import create_tenant

pytestmark = pytest.mark.timeout(120)

FLEET = 12  # episodes in flight across all tenants
ADMITTED = 90  # episodes admitted before the shares are counted


def one_turn(req: InferenceRequest) -> str:
    """Run a command and submit: one inference, one sandbox and one reward step per episode
    (a lone file write and submit would skip the sandbox: its file rides on the reward request)."""
    return f"{FENCE}bash\nprintf 'def add(a, b):\\n    return a + b\\n' > add.py\n{FENCE}\nsubmit"


async def tenant_with_job(db: Database, name: str, *, weight: float = 1.0, **spec: object) -> str:
    """A tenant (with its own task set) and one pending job; returns the job id."""
    await seed(db, tenant=name, taskset=f"ts-{name}", tasks={f"{name}-t{i}": {} for i in range(3)})
    async with db.session() as s:
        await s.execute(update(Tenant).where(Tenant.id == name).values(weight=weight))
    return await submit_job(db, job_spec(tasks__taskset=f"ts-{name}", **spec), tenant=name)


def pause_after_admitting(monkeypatch: pytest.MonkeyPatch, n: int) -> asyncio.Event:
    """Stop the scheduler at the end of the tick in which its fleet admitted ``n`` episodes;
    the event says it has. Counts read then hold whole ticks: a tick admits every tenant's
    planned room in turn, one job's pass at a time, so counts read while one is under way
    can hold one tenant's share of it and not yet the other's (up to a fleet's worth)."""
    paused = asyncio.Event()
    tick = Scheduler.tick

    async def tick_then_pause(self: Scheduler) -> None:
        await tick(self)
        if sum(self.fleet.admitted.values()) >= n:
            paused.set()
            await asyncio.Event().wait()  # until the dispatcher stops

    monkeypatch.setattr(Scheduler, "tick", tick_then_pause)
    return paused


@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_contended_fleet_admits_episodes_two_to_one_by_weight(tmp_path, database_url, monkeypatch):
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    u = uuid.uuid4().hex[:8]
    # each job alone would fill the fleet ten times over
    big = dict(
        tasks__group_size=1, schedule__episodes_per_iteration=400, schedule__max_concurrent_episodes=64
    )
    light = await tenant_with_job(db, f"light-{u}", weight=1.0, **big)  # submitted first
    heavy = await tenant_with_job(db, f"heavy-{u}", weight=2.0, **big)
    await db.dispose()

    paused = pause_after_admitting(monkeypatch, ADMITTED)
    h = await start_harness(
        tmp_path,
        database_url,
        migrate=False,
        fleet_max_episodes=FLEET,
        peers={"script": one_turn},
    )
    try:
        in_flight_seen: list[int] = []

        async def admitted() -> bool:
            async with h.db.session() as s:
                in_flight_seen.append(
                    await s.scalar(
                        select(func.count())
                        .select_from(Episode)
                        .where(Episode.job_id.in_([light, heavy]), Episode.state.not_in(["scored", "failed"]))
                    )
                    or 0
                )
            return paused.is_set()

        await wait_for(admitted, limit_s=90, what=f"{ADMITTED} episodes admitted")
        per_job = {job: len(await episodes_of(h.db, job)) for job in (light, heavy)}
    finally:
        await h.stop()
    ratio = per_job[heavy] / per_job[light]
    assert abs(ratio - 2.0) <= 0.2, f"admitted {per_job}: {ratio:.2f}, wanted 2:1 within 10 %"
    # The work each fleet was given follows the admissions exactly: a request only for an
    # admitted episode of the job it names, and one for every episode that was scored. (A
    # ratio of request counts would be off by the episodes in flight when the peers stopped.)
    db = Database(DatabaseSettings(url=database_url))
    try:
        episodes = {job: await episodes_of(db, job) for job in (light, heavy)}
    finally:
        await db.dispose()
    for kind in ("inference", "sandbox"):
        for job, rows in episodes.items():
            sent = {m.episode_id for m in h.peers.requests[kind] if m.job_id == job}
            assert sent <= {e.id for e in rows}, f"{kind} requests for episodes {job} never admitted"
            scored = {e.id for e in rows if e.state == "scored"}
            assert scored and scored <= sent, f"{kind}: scored episodes of {job} with no request"
    assert max(in_flight_seen) <= FLEET, in_flight_seen


# each quota, the usage field it limits, the limit, and what one sandbox action reports:
# the job pauses after two actions' worth
QUOTA_CASES = {
    "cpu": ("quota_sandbox_cpu_s", "sandbox_cpu_s", 0.5, {"cpu_s": 0.25}),
    # 256 MB held for 2 s: 0.5 GB-seconds an action
    "memory": (
        "quota_sandbox_memory_gb_s",
        "sandbox_memory_gb_s",
        1.0,
        {"peak_memory_mb": 256, "wall_s": 2.0},
    ),
}


def per_action(used: str, reports: dict[str, float]) -> float:
    if used == "sandbox_cpu_s":
        return reports["cpu_s"]
    return reports["peak_memory_mb"] / 1024 * reports["wall_s"]


@pytest.mark.parametrize(
    ("case", "database_url"),
    [("cpu", "sqlite"), pytest.param("cpu", "postgres", marks=pytest.mark.postgres), ("memory", "sqlite")],
    indirect=["database_url"],
)
async def test_a_tenant_over_its_quota_is_paused_not_failed_and_resumes_when_it_is_raised(
    tmp_path, database_url, case
):
    quota, used, limit, reports = QUOTA_CASES[case]
    step = per_action(used, reports)
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    name = f"thrifty-{uuid.uuid4().hex[:8]}"
    # 8 episodes, 2 at a time; each runs one sandbox action that reports ``step`` of the usage
    job = await tenant_with_job(
        db, name, tasks__group_size=2, schedule__episodes_per_iteration=8, schedule__max_concurrent_episodes=2
    )
    async with db.session() as s:
        await s.execute(update(Tenant).where(Tenant.id == name).values({quota: limit}))
        _, admin = await create_tenant(s, name="ops", tenant_id=f"ops-{name}", admin=True)
    await db.dispose()

    h = await start_harness(tmp_path, database_url, migrate=False, peers={"sandbox_reports": reports})
    app = create_app(settings_for(tmp_path, database_url), run_episodes=False)
    try:
        await wait_for(lambda: paused(h.db, job), limit_s=60, what="the job paused for its quota")
        async with h.db.session() as s:
            reason = await s.scalar(select(Job.state_reason).where(Job.id == job))
        # the pause is noticed at the scheduler's next tick, so actions already in flight may
        # have added to the usage by then: at least the quota, and a whole number of actions
        found = re.fullmatch(rf"quota {used} exceeded: used (\d+\.\d{{3}}) of {limit:g}", reason or "")
        assert found, reason
        used_at_pause = float(found.group(1))
        assert used_at_pause >= limit and (used_at_pause / step).is_integer(), reason
        await asyncio.sleep(1.0)  # paused stays paused, and starts nothing more
        assert await job_state(h.db, job) == "paused"
        assert len(await episodes_of(h.db, job)) == 2

        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://d",
                headers={"Authorization": f"Bearer {admin.key}"},
            ) as c,
        ):
            seen = (await c.get(f"/v1/tenants/{name}")).json()
            assert seen[quota] == limit and seen["weight"] == 1.0
            # the episodes in flight when it paused finished, and counted
            assert seen[f"used_{used}"] == pytest.approx(step * len(h.peers.requests["sandbox"]))
            assert seen[f"used_{used}"] >= used_at_pause
            assert seen["used_inference_tokens"] == await tokens_in_steps(h.db, job) > 0
            assert seen["used_trainer_s"] == 0.0  # no trainer here: no version published
            assert (await c.get(f"/v1/jobs/{job}")).status_code == 404  # another tenant's job
            r = await c.patch(f"/v1/tenants/{name}", json={quota: limit * 20, "weight": 3})
            assert r.status_code == 200 and r.json()[quota] == limit * 20 and r.json()["weight"] == 3
            bad = await c.patch(f"/v1/tenants/{name}", json={"weight": 0})
            assert bad.status_code == 422 and "weight" in bad.text

        async def done() -> bool:
            return await job_state(h.db, job) == "completed"

        await wait_for(done, limit_s=60, what="the job completed once its quota was raised")
        states = Counter(e.state for e in await episodes_of(h.db, job))
    finally:
        await h.stop()
    assert states == {"scored": 8}, states


async def test_trainer_time_counts_against_its_quota(tmp_path, database_url):
    """The trainer's seconds are on its policy versions (``train_s``); a tenant whose jobs
    took its trainer quota starts nothing more: its new job pauses before any episode."""
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    name = f"trained-{uuid.uuid4().hex[:8]}"
    earlier = await tenant_with_job(db, name)
    async with db.session() as s:
        for version, seconds in ((1, 1.5), (2, 2.0)):
            s.add(PolicyVersion(job_id=earlier, version=version, checkpoint_key=f"k{version}", step=version,
                                train_s=seconds))  # fmt: skip
        await s.execute(update(Job).where(Job.id == earlier).values(state="completed"))
        await s.execute(update(Tenant).where(Tenant.id == name).values(quota_trainer_s=3.0))
    async with db.session() as s:
        usage = await tenant_usage(s, [name, "nobody"])
        assert usage[name].trainer_s == 3.5 and usage["nobody"] == Usage()
    job = await submit_job(db, job_spec(tasks__taskset=f"ts-{name}"), tenant=name)
    await db.dispose()

    h = await start_harness(tmp_path, database_url, migrate=False)
    try:
        await wait_for(lambda: paused(h.db, job), limit_s=60, what="the new job paused for the quota")
        async with h.db.session() as s:
            reason = await s.scalar(select(Job.state_reason).where(Job.id == job))
        assert reason == "quota trainer_s exceeded: used 3.500 of 3", reason
        assert await episodes_of(h.db, job) == []
    finally:
        await h.stop()


async def paused(db: Database, job_id: str) -> bool:
    return await job_state(db, job_id) == "paused"


async def tokens_in_steps(db: Database, job_id: str) -> int:
    """Prompt and sampled tokens of the job's answered inference steps, counted from the steps."""
    async with db.session() as s:
        steps = (
            await s.execute(
                select(Step)
                .join(Episode, Episode.id == Step.episode_id)
                .where(Episode.job_id == job_id, Step.kind == "inference", Step.state == "done")
            )
        ).scalars()
        return sum(len(st.request["prompt_ids"]) + len(st.result["token_ids"]) for st in steps)


async def test_past_the_fleets_capacity_a_job_waits_with_the_reason_and_nothing_fails(tmp_path, database_url):
    """A job that wants more episodes than the fleet holds starts what fits, says why the
    rest wait in its reason, and goes on (the reason cleared) as room frees up."""
    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    u = uuid.uuid4().hex[:8]
    job = await tenant_with_job(
        db,
        f"big-{u}",
        tasks__group_size=1,
        schedule__episodes_per_iteration=6,
        schedule__max_concurrent_episodes=6,
    )
    await db.dispose()
    h = await start_harness(
        tmp_path, database_url, migrate=False, fleet_max_episodes=4, peers={"script": one_turn}
    )
    try:
        h.peers.hold = True  # the first four wait on their model, so the fleet stays full

        async def four_wait() -> bool:
            async with h.db.session() as s:
                reason = await s.scalar(select(Job.state_reason).where(Job.id == job))
            return len(await episodes_of(h.db, job)) == 4 and reason is not None

        await wait_for(four_wait, limit_s=30, what="four episodes started and a reason")
        async with h.db.session() as s:
            row = await s.get(Job, job)
            assert row is not None
            assert (row.state, row.state_reason) == (
                "running",
                "stuck: waiting for room: the fleet runs its fleet_max_episodes (4)",
            )
        await h.peers.release()

        async def completed() -> bool:
            return await job_state(h.db, job) == "completed"

        await wait_for(completed, limit_s=60, what="the job completed")
        async with h.db.session() as s:
            row = await s.get(Job, job)
            assert row is not None and row.state_reason is None
        states = Counter(e.state for e in await episodes_of(h.db, job))
        assert states == {"scored": 6}
    finally:
        await h.stop()
