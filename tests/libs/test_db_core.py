"""temper.db.core: the same Core statements give the same rows whichever executor runs them
(asyncpg straight on Postgres, SQLAlchemy on SQLite and inside a session), defaults and
onupdate values included; a failed transaction leaves nothing; what the driver cannot
run is refused by name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Table, bindparam, event, select

from temper.db import Database, Episode, Job, OutboxRow, Step, Tenant, rows
from temper.db.core import DriverTx, SessionTx, one_of
from temper.lifecycle import new_step

pytestmark = pytest.mark.timeout(60)
STEPS = Step.__table__
EPISODES = Episode.__table__
assert isinstance(STEPS, Table) and isinstance(EPISODES, Table)
_STEPS_OF = (
    select(*(STEPS.c[c] for c in rows.columns(Step)))
    .where(STEPS.c.episode_id == bindparam("episode_id"))
    .order_by(STEPS.c.id)
)
_EPISODE = select(*(EPISODES.c[c] for c in rows.columns(Episode))).where(EPISODES.c.id == bindparam("id"))


async def _seed(db: Database) -> None:
    async with db.session() as s:
        s.add(Tenant(id="acme", name="acme"))
        await s.flush()
        s.add(Job(id="j", tenant_id="acme", name="j", spec={}, state="running"))
        await s.flush()
        s.add(Episode(id="e", job_id="j", tenant_id="acme", task_id="t", group_id="g", state="acting"))


async def test_rows_written_and_read_back_alike(database: Database) -> None:
    await _seed(database)
    lease = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    async with database.core() as tx:
        assert isinstance(tx, DriverTx if not database.is_sqlite else SessionTx)
        made = [
            new_step(
                episode_id="e",
                turn=t,
                kind="inference",
                request={"prompt_ids": [t, 2]},
                lease_expires_at=lease,
            )
            for t in range(3)
        ]
        made[1].result = {"token_ids": [5], "logprobs": [-0.5], "text": "ünïcode"}
        # a row inserted with only some columns gets the others' Python-side defaults
        bare = rows.new(Step, episode_id="e", turn=9, kind="sandbox")
        await rows.write(tx, [*made, bare])
        assert [s.id for s in made] == sorted(s.id for s in made)  # keys in the rows' order
        got = await tx.rows(_STEPS_OF, {"episode_id": "e"})
    assert [r[0] for r in got] == [s.id for s in [*made, bare]]
    back = [rows.loaded(Step, dict(zip(rows.columns(Step), r, strict=True))) for r in got]
    assert [s.request for s in back] == [
        {"prompt_ids": [0, 2]},
        {"prompt_ids": [1, 2]},
        {"prompt_ids": [2, 2]},
        {},
    ]
    assert back[1].result == {"token_ids": [5], "logprobs": [-0.5], "text": "ünïcode"}
    assert back[0].result is None and back[3].attempt == 0 and back[3].state == "leased"
    assert back[0].lease_expires_at == lease and back[0].lease_expires_at.tzinfo is not None
    assert abs(back[3].created_at - datetime.now(UTC)) < timedelta(seconds=30)

    # the ORM reads the same values the driver wrote
    async with database.session() as s:
        orm = (await s.execute(select(Step).order_by(Step.id))).scalars().all()
        assert [(o.turn, o.request, o.result, o.lease_expires_at) for o in orm] == [
            (b.turn, b.request, b.result, b.lease_expires_at) for b in back
        ]


async def test_updates_fill_in_onupdate_and_change_only_their_columns(database: Database) -> None:
    await _seed(database)
    async with database.session() as s:
        before = (await s.get(Episode, "e")).updated_at  # type: ignore[union-attr]
    async with database.core() as tx:
        ((*values,),) = await tx.rows(_EPISODE, {"id": "e"})
        ep = rows.loaded(Episode, dict(zip(rows.columns(Episode), values, strict=True)))
        ep.reward = 0.25
        ep.rewards = {"tests_passed": {"value": 0.25}}
        await rows.write(tx, [ep])
    async with database.session() as s:
        after = await s.get(Episode, "e")
        assert after is not None
        assert (after.reward, after.rewards, after.state) == (
            0.25,
            {"tests_passed": {"value": 0.25}},
            "acting",
        )
        assert after.updated_at > before  # the column's onupdate, as an ORM flush sets it


async def test_a_failed_transaction_writes_nothing(database: Database) -> None:
    await _seed(database)
    with pytest.raises(RuntimeError, match="boom"):
        async with database.core() as tx:
            rows.stage(
                tx, new_step(episode_id="e", turn=0, kind="inference", request={}, lease_expires_at=None)
            )  # type: ignore[arg-type]
            await rows.write_staged(tx)
            raise RuntimeError("boom")
    async with database.core() as tx:
        assert await tx.rows(_STEPS_OF, {"episode_id": "e"}) == []


async def test_outbox_rows_get_ascending_ids_in_order(database: Database) -> None:
    table = OutboxRow.__table__
    assert isinstance(table, Table)
    names = frozenset({"topic", "key", "payload", "created_at", "claimed_until"})
    now = datetime.now(UTC)
    inserts: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        inserts.extend([statement] if statement.startswith("INSERT") else [])

    event.listen(database.engine.sync_engine, "before_cursor_execute", count)
    async with database.core() as tx:
        ids = await tx.insert_many(
            table,
            names,
            [
                {
                    "topic": f"t{i}",
                    "key": "k",
                    "payload": bytes([i]),
                    "created_at": now,
                    "claimed_until": None,
                }
                for i in range(5)
            ],
        )
    async with database.session() as s:
        found = {r.id: (r.topic, r.payload) for r in (await s.execute(select(OutboxRow))).scalars()}
    assert [found[i] for (i,) in ids] == [(f"t{i}", bytes([i])) for i in range(5)]
    # one statement for the five rows where SQLAlchemy runs it (asyncpg's are not counted)
    assert len(inserts) == (0 if isinstance(tx, DriverTx) else 1), inserts


async def test_a_transactions_writes_go_together_and_read_back_right(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inserts into two tables and updates of two tables (one of them in two sets of
    columns) from one ``rows.write``: on Postgres one statement, whose keys come back to
    the right rows in their order; every value reads back as written, the episode's
    onupdate included, and columns nobody set are left alone."""
    import asyncpg

    await _seed(database)
    async with database.core() as tx:
        old = [
            new_step(episode_id="e", turn=t, kind="inference", request={"t": t}, lease_expires_at=None)
            for t in range(2)
        ]
        await rows.write(tx, old)
    async with database.session() as s:
        before = (await s.get(Episode, "e")).updated_at  # type: ignore[union-attr]
    sent: list[str] = []
    for name in ("fetch", "execute", "executemany"):
        original = getattr(asyncpg.Connection, name)

        def counted(self, query, *args, _original=original, **kwargs):  # noqa: ANN001, ANN202
            sent.append(query)
            return _original(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.Connection, name, counted)
    now = datetime.now(UTC)
    async with database.core() as tx:
        ((*values,),) = await tx.rows(_EPISODE, {"id": "e"})
        ep = rows.loaded(Episode, dict(zip(rows.columns(Episode), values, strict=True)))
        got = await tx.rows(_STEPS_OF, {"episode_id": "e"})
        first, second = (rows.loaded(Step, dict(zip(rows.columns(Step), r, strict=True))) for r in got)
        ep.turn, ep.rewards = 3, {"x": {"value": 0.5}}
        first.result, first.state = {"text": "done"}, "done"  # two sets of columns on one table
        second.attempt = 2
        made = [
            new_step(episode_id="e", turn=t, kind="sandbox", request={"n": t}, lease_expires_at=now)
            for t in (7, 8, 9)
        ]
        out = [
            rows.new(OutboxRow, topic=f"t{i}", key="k", payload=bytes([i]), created_at=now) for i in range(4)
        ]
        sent.clear()
        await rows.write(tx, [ep, first, *made, *out, second])
        writes = list(sent)
    if not database.is_sqlite:
        assert len(writes) == 1 and writes[0].startswith("WITH "), writes
    assert [s.id for s in made] == sorted(s.id for s in made) and made[0].id > old[1].id
    assert [o.id for o in out] == sorted(o.id for o in out)
    async with database.session() as s:
        back = {r.id: r for r in (await s.execute(select(Step))).scalars()}
        assert [(back[m.id].turn, back[m.id].request, back[m.id].lease_expires_at) for m in made] == [
            (t, {"n": t}, now) for t in (7, 8, 9)
        ]
        assert (back[first.id].result, back[first.id].state, back[first.id].attempt) == (
            {"text": "done"},
            "done",
            0,
        )
        assert (back[second.id].result, back[second.id].state, back[second.id].attempt) == (None, "leased", 2)
        boxed = {r.id: (r.topic, r.payload) for r in (await s.execute(select(OutboxRow))).scalars()}
        assert [boxed[o.id] for o in out] == [(f"t{i}", bytes([i])) for i in range(4)]
        after = await s.get(Episode, "e")
        assert after is not None
        assert (after.turn, after.rewards, after.state) == (3, {"x": {"value": 0.5}}, "acting")
        assert after.updated_at > before


@pytest.mark.postgres
async def test_the_driver_refuses_an_expanding_in(postgres_database_url: str) -> None:
    import asyncio

    from temper.db.migrate import upgrade
    from temper.settings import DatabaseSettings

    await asyncio.to_thread(upgrade, postgres_database_url)
    db = Database(DatabaseSettings(url=postgres_database_url))
    try:
        expanding = select(STEPS.c.id).where(STEPS.c.state.in_(["leased", "done"]))
        async with db.core() as tx:
            with pytest.raises(ValueError, match="IN of a list is not run on the driver"):
                await tx.rows(expanding)
        async with db.core() as tx:  # the fixed-list form runs
            assert await tx.rows(select(STEPS.c.id).where(one_of(STEPS.c.state, ["leased", "done"]))) == []
    finally:
        await db.dispose()
