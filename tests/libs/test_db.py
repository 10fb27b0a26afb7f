from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import inspect, select
from sqlalchemy.exc import IntegrityError

from temper.db import Database, DatabaseUnavailable, Episode, Job, Step, Tenant
from temper.db.migrate import downgrade, upgrade
from temper.db.models import Base
from temper.settings import DatabaseSettings

TABLES = set(Base.metadata.tables)


async def _tables(db: Database) -> set[str]:
    async with db.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names())) - {"alembic_version"}


async def test_migrations_upgrade_and_downgrade(database_url):
    db = Database(DatabaseSettings(url=database_url))
    await asyncio.to_thread(upgrade, database_url)
    assert await _tables(db) == TABLES
    await asyncio.to_thread(downgrade, database_url, "base")
    assert await _tables(db) == set()
    await asyncio.to_thread(upgrade, database_url)
    assert await _tables(db) == TABLES
    await db.dispose()


async def test_models_round_trip_json_and_a_step_is_recorded_once(database: Database):
    async with database.session() as s:
        s.add(Tenant(id="t1", name="Team One"))
        await s.flush()
        s.add(Job(id="j1", tenant_id="t1", name="demo", spec={"policy": {"model": "tiny"}}))
        await s.flush()
        s.add(
            Episode(
                id="e1", job_id="j1", tenant_id="t1", task_id="task-1", group_id="g1", rewards={"tests": 1.0}
            )
        )
        await s.flush()
        s.add(Step(episode_id="e1", turn=0, kind="inference", request={"prompt_ids": [1, 2]}))
    async with database.session() as s:
        ep = await s.get(Episode, "e1")
        assert ep.rewards == {"tests": 1.0}
        job = await s.get(Job, "j1")
        assert job.spec["policy"]["model"] == "tiny"
    with pytest.raises(IntegrityError):
        async with database.session() as s:
            s.add(Step(episode_id="e1", turn=0, kind="inference"))
    async with database.session() as s:
        steps = (await s.execute(select(Step))).scalars().all()
        assert len(steps) == 1


async def test_an_unreachable_database_names_the_setting_and_hides_the_password():
    db = Database(DatabaseSettings(url="postgresql+asyncpg://temper:hunter2@127.0.0.1:1/temper"))
    with pytest.raises(DatabaseUnavailable) as info:
        await db.check()
    assert "TEMPER_DB__URL=postgresql+asyncpg://temper:***@127.0.0.1:1/temper" in str(info.value)
    assert "hunter2" not in str(info.value)
    await db.dispose()


def test_an_unsupported_database_url_is_refused_by_the_settings():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="TEMPER_DB__URL must start with"):
        DatabaseSettings(url="mysql://root@localhost/temper")


async def test_datetimes_come_back_aware_utc_and_naive_ones_are_refused(database: Database):
    from datetime import UTC, datetime, timedelta, timezone

    paris = timezone(timedelta(hours=1))
    async with database.session() as s:
        s.add(Tenant(id="tz", name="zones", created_at=datetime(2026, 1, 1, 13, 0, tzinfo=paris)))
    async with database.session() as s:
        created = (await s.execute(select(Tenant.created_at).where(Tenant.id == "tz"))).scalar_one()
        # compared with an aware bound in SQL too: both sides are UTC
        later = await s.scalar(
            select(Tenant.id).where(Tenant.created_at > datetime(2026, 1, 1, 11, 59, tzinfo=UTC))
        )
    assert created == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert created.tzinfo is UTC
    assert later == "tz"
    with pytest.raises(Exception, match="naive datetime 2026-01-01T12:00:00"):
        async with database.session() as s:
            s.add(Tenant(id="naive", name="no zone", created_at=datetime(2026, 1, 1, 12, 0)))


def test_the_migrations_are_one_chain():
    """One head, each revision numbered after the one it revises: two branches that each
    add a migration must be chained when they meet (``upgrade head`` refuses two heads)."""
    from alembic.script import ScriptDirectory

    from temper.db.migrate import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite+aiosqlite:///:memory:"))
    assert script.get_heads() == [script.get_current_head()] and len(script.get_heads()) == 1
    for rev in script.walk_revisions():
        if rev.down_revision is not None:
            assert int(rev.revision[:4]) == int(str(rev.down_revision)[:4]) + 1, rev.revision
