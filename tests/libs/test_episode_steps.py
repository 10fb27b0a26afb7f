"""Finished episodes' steps move to object storage after a window and read back the same
through the one reader; live episodes keep theirs; retention keeps the archive."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select

from temper.clock import utcnow
from temper.db import Database, Episode, Job, Step, Tenant
from temper.episode_steps import archive_finished, read_steps, steps_key
from temper.lifecycle import EpisodeState, StepState, new_step
from temper.retention import delete_expired
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(60)
E, S = EpisodeState, StepState


async def _seed(db: Database, *, finished_ago_s: float) -> None:
    long_ago = utcnow() - timedelta(seconds=finished_ago_s)
    async with db.session() as s:
        s.add(Tenant(id="acme", name="acme"))
        await s.flush()
        s.add(Job(id="j", tenant_id="acme", name="j", spec={}, state="completed", finished_at=long_ago))
        await s.flush()
        for eid, state in (("done", E.scored), ("live", E.acting), ("failed", E.failed)):
            s.add(Episode(id=eid, job_id="j", tenant_id="acme", task_id="t", group_id="g", state=state,
                          trajectory_key=f"tenants/acme/jobs/j/trajectories/{eid}.json",
                          updated_at=long_ago))  # fmt: skip
        await s.flush()
        for eid in ("done", "live", "failed"):
            for turn in (0, 1):
                step = new_step(
                    episode_id=eid,
                    turn=turn,
                    kind="inference",
                    request={"prompt_ids": [1, 2, turn]},
                    lease_expires_at=utcnow(),
                )
                if eid != "live" or turn == 0:
                    step.state, step.result = S.done, {"token_ids": [7, turn], "text": f"turn {turn} é"}
                    step.lease_expires_at, step.completed_at = None, long_ago
                s.add(step)


def _content(steps: list[Step]) -> list[tuple]:
    return [
        (
            s.id,
            s.episode_id,
            s.turn,
            s.kind,
            s.attempt,
            s.state,
            s.request,
            s.result,
            s.created_at,
            s.completed_at,
        )
        for s in steps
    ]


async def test_finished_episodes_steps_are_archived_and_read_back_the_same(database: Database, tmp_path):
    store = LocalStore(tmp_path / "objects")
    await _seed(database, finished_ago_s=7200)
    async with database.session() as s:
        episodes = {e.id: e for e in (await s.execute(select(Episode))).scalars()}
        before = {eid: _content(await read_steps(s, store, ep)) for eid, ep in episodes.items()}
    assert [len(v) for v in before.values()] == [2, 2, 2]

    assert await archive_finished(database, store, after_s=3600) == 2  # scored and failed; not the live one
    assert await archive_finished(database, store, after_s=3600) == 0  # nothing left to move

    async with database.session() as s:
        left = dict((await s.execute(select(Step.episode_id, func.count()).group_by(Step.episode_id))).all())
        assert left == {"live": 2}
        for ep in (await s.execute(select(Episode))).scalars():
            assert ep.steps_key == (steps_key("acme", "j", ep.id) if ep.id != "live" else None)
            # the one reader gives the same rows, from the archive or from Postgres
            assert _content(await read_steps(s, store, ep)) == before[ep.id]
    assert await store.exists(steps_key("acme", "j", "done"))

    # Retention expires the trajectories, not the archived steps.
    await store.put("tenants/acme/jobs/j/trajectories/done.json", b"{}", "application/json")
    counts = await delete_expired(store, database, days=0.01)
    assert counts["trajectories"] == 1
    assert await store.exists(steps_key("acme", "j", "done"))


async def test_steps_within_the_window_stay_in_postgres(database: Database, tmp_path):
    store = LocalStore(tmp_path / "objects")
    await _seed(database, finished_ago_s=60)
    assert await archive_finished(database, store, after_s=3600) == 0
    async with database.session() as s:
        assert await s.scalar(select(func.count()).select_from(Step)) == 6
