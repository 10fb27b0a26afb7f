"""Trajectories handed over at once are buffered in one ledger transaction, and each
caller still gets what it would alone (services/trainer/receipts.py)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import event, select

from services.trainer.component import Trainer
from temper.bus import Poison
from temper.db import TrainedTrajectory
from temper.db.migrate import upgrade
from temper.runtime import Runtime
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings
from tests.services.trainer.factory import TrajectoryFactory, add_job, job_spec, store_all

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def trainer(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    settings = Settings(
        db=DatabaseSettings(url=url),
        storage=StorageSettings(root=tmp_path / "objects"),
        log=LogSettings(level="WARNING"),
    )
    runtime = Runtime(settings, service="trainer")
    await runtime.start()
    # groups of 8 that never complete a step's worth: nothing is trained while the test looks
    component = Trainer(runtime, settings=settings.trainer.model_copy(update={"device": "cpu"}))
    await component.start()
    assert runtime.db is not None and runtime.store is not None
    await add_job(runtime.db, "job-r", job_spec(group_size=8, groups_per_step=4))
    yield runtime, component.training
    await component.stop()
    await runtime.stop()


def count_ledger_inserts(runtime: Runtime) -> list[int]:
    """Statements that insert ledger rows, each with how many rows it wrote."""
    writes: list[int] = []
    engine = runtime.db.engine.sync_engine  # type: ignore[union-attr]

    @event.listens_for(engine, "before_cursor_execute")
    def seen(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        if statement.lstrip().upper().startswith("INSERT INTO TRAINED_TRAJECTORIES"):
            writes.append(len(parameters) if executemany else 1)

    return writes


async def rows_of(runtime: Runtime) -> dict[str, TrainedTrajectory]:
    async with runtime.db.session() as s:  # type: ignore[union-attr]
        return {r.episode_id: r for r in (await s.scalars(select(TrainedTrajectory))).all()}


async def test_trajectories_handed_over_together_share_one_transaction_and_each_is_buffered_once(trainer):
    runtime, training = trainer
    f = TrajectoryFactory("job-r")
    first = f.group("g0", [1.0])
    together = f.group("g1", [0.0, 1.0, 1.0, 0.0]) + f.group("g2", [1.0, 0.0, 0.0])
    await store_all(runtime.store, first + together)
    await training.receive(first[0].message)  # the job is loaded by a trajectory alone
    writes = count_ledger_inserts(runtime)

    # seven at once, one of them twice (a redelivery racing its first delivery)
    messages = [m.message for m in together] + [together[2].message]
    await asyncio.gather(*(training.receive(m) for m in messages))

    assert sum(writes) == 7 and len(writes) < 7, f"ledger inserts (rows each): {writes}"
    rows = await rows_of(runtime)
    assert set(rows) == {m.message.episode_id for m in first + together}
    for m in together:
        row = rows[m.message.episode_id]
        assert (row.job_id, row.trajectory_key, row.group_id, row.step, row.skipped) == (
            "job-r", m.message.trajectory_key, m.trajectory.group_id, None, None,
        )  # fmt: skip
    job = training.jobs["job-r"]
    buffered = sorted(b.episode_id for g in (*job.groups.values(), *job.ready) for b in g)
    assert buffered == sorted(m.message.episode_id for m in first + together)
    # what was buffered is the trajectory stored for that episode, token for token
    for m in together:
        (item,) = [b for g in job.groups.values() for b in g if b.episode_id == m.message.episode_id]
        assert item.trajectory == m.trajectory

    # handed over again later, together: nothing new
    await asyncio.gather(*(training.receive(m.message) for m in together))
    assert sum(writes) == 7
    assert len(await rows_of(runtime)) == 8


async def test_a_bad_trajectory_in_a_batch_fails_alone_and_the_others_are_buffered(trainer):
    runtime, training = trainer
    f = TrajectoryFactory("job-r")
    first = f.group("g0", [1.0])
    good = f.group("g1", [0.0, 1.0, 1.0])
    bad = f.group("g2", [1.0])
    await store_all(runtime.store, first + good)
    await runtime.store.put(bad[0].message.trajectory_key, b'{"not": "a trajectory"}', "application/json")
    await training.receive(first[0].message)

    results = await asyncio.gather(*(training.receive(m.message) for m in good + bad), return_exceptions=True)

    assert results[:3] == [None, None, None]
    assert isinstance(results[3], Poison) and "is not a trajectory" in str(results[3])
    rows = await rows_of(runtime)
    assert set(rows) == {m.message.episode_id for m in first + good}, "the bad one has no row"
    assert sorted(b.episode_id for b in training.jobs["job-r"].groups["g1"]) == sorted(
        m.message.episode_id for m in good
    )
