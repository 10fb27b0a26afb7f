from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from temper.bus import InProcessBus, Record
from temper.db import Database, OutboxRow
from temper.events import LifecycleEvent
from temper.outbox import OutboxRelay, enqueue


class RelayCrashed(Exception):
    pass


def event(n: int) -> LifecycleEvent:
    return LifecycleEvent(event="job.state", job_id=f"job-{n}", state="running")


async def test_relay_delivers_exactly_the_committed_rows_even_after_a_crash(database: Database):
    bus = InProcessBus(partitions=2)
    await bus.create_topics(["events"])
    delivered: list[str] = []

    async def collect(record: Record) -> None:
        delivered.append(LifecycleEvent.model_validate_json(record.value).job_id)

    await bus.subscribe(["events"], "analytics", collect)

    # Committed rows 0..4, a rolled-back transaction that wrote 100..102, committed 5..9.
    async with database.session() as s:
        for n in range(5):
            enqueue(s, "events", event(n))
    with pytest.raises(RuntimeError):
        async with database.session() as s:
            for n in range(100, 103):
                enqueue(s, "events", event(n))
            raise RuntimeError("the state change failed")
    async with database.session() as s:
        for n in range(5, 10):
            enqueue(s, "events", event(n))

    async def crash(ids: list[int]) -> None:
        raise RelayCrashed("killed between publishing and marking")

    with pytest.raises(RelayCrashed):
        await OutboxRelay(database, bus, batch=4, after_publish=crash).publish_pending()

    relay = OutboxRelay(database, bus, batch=4)
    while await relay.publish_pending():
        pass
    assert await relay.pending() == 0
    import asyncio

    for _ in range(100):
        if len(set(delivered)) == 10:
            break
        await asyncio.sleep(0.01)
    expected = {f"job-{n}" for n in range(10)}
    assert set(delivered) == expected, "every committed row, and no rolled-back one"
    assert len(delivered) == 14, "the 4 rows published before the crash went out twice (at-least-once)"
    async with database.session() as s:
        assert await s.scalar(select(func.count()).select_from(OutboxRow)) == 10


async def test_rows_of_one_key_are_published_in_commit_order(database: Database):
    bus = InProcessBus(partitions=3)
    await bus.create_topics(["events"])
    async with database.session() as s:
        for n in range(20):
            enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e1", state=f"s{n}"))
    relay = OutboxRelay(database, bus, batch=7)
    while await relay.publish_pending():
        pass
    records = [r for part in bus.topics["events"] for r in part]
    assert [LifecycleEvent.model_validate_json(r.value).state for r in records] == [
        f"s{n}" for n in range(20)
    ]


class FlakyBus(InProcessBus):
    """Refuses sends while ``down`` is set."""

    down = False

    async def send(self, topic, value, key=None, headers=None):
        if self.down:
            raise ConnectionError("broker unreachable")
        await super().send(topic, value, key=key, headers=headers)


def published_states(bus: InProcessBus) -> list[str]:
    return [LifecycleEvent.model_validate_json(r.value).state for part in bus.topics["events"] for r in part]


async def test_a_transaction_publishes_its_rows_at_commit_and_the_sweep_only_marks_them(database: Database):
    bus = FlakyBus(partitions=1)
    await bus.create_topics(["events"])
    relay = OutboxRelay(database, bus)

    async with relay.transaction() as s:
        enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e1", state="fast"))
        assert published_states(bus) == [], "nothing goes out before the commit"
    assert published_states(bus) == ["fast"], "sent right after the commit, with no relay pass"
    assert await relay.pending() == 1, "sent but not yet marked"

    with pytest.raises(RuntimeError):
        async with relay.transaction() as s:
            enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e1", state="rolled back"))
            raise RuntimeError("the state change failed")

    bus.down = True
    async with relay.transaction() as s:  # committed, but the send fails: the sweep owes it
        enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e1", state="after a blip"))
    assert published_states(bus) == ["fast"]
    bus.down = False

    assert await relay.publish_pending() == 1, "the sweep sends only the row the fast path could not"
    assert published_states(bus) == ["fast", "after a blip"], "nothing re-sent, nothing rolled back sent"
    assert await relay.pending() == 0, "and every row is marked"
    assert await relay.publish_pending() == 0


async def test_a_row_has_one_relay_the_writer_until_its_claim_runs_out(database: Database):
    """The dispatcher's fast path and the trainer's sweep share the outbox: the sweep of
    another process leaves rows the writer is relaying, so each command is sent once; a
    row whose writer never sent it is taken over once its claim runs out."""
    bus = FlakyBus(partitions=1)
    await bus.create_topics(["events"])
    writer = OutboxRelay(database, bus, claim_s=60)
    other = OutboxRelay(database, bus)  # another process's relay, e.g. the trainer's

    async with writer.transaction() as s:
        enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e1", state="fast"))
    assert published_states(bus) == ["fast"]
    assert await other.publish_pending() == 0, "sent by the writer, not yet marked: not the sweep's"
    assert await writer.publish_pending() == 0
    assert await writer.pending() == 0
    assert published_states(bus) == ["fast"], "exactly once"

    # A writer that committed and then died before sending: nobody sends until its claim
    # runs out, then exactly one relay does.
    dying = OutboxRelay(database, bus, claim_s=0.3)
    bus.down = True
    async with dying.transaction() as s:
        enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e2", state="orphan"))
    bus.down = False
    assert await other.publish_pending() == 0, "still claimed by its writer"
    await asyncio.sleep(0.4)
    assert await other.publish_pending() == 1
    assert await other.publish_pending() == 0
    assert published_states(bus) == ["fast", "orphan"]

    # The writer's own sweep takes back a row its fast path failed to send, claim or not.
    bus.down = True
    async with writer.transaction() as s:
        enqueue(s, "events", LifecycleEvent(event="episode.state", episode_id="e3", state="retried"))
    bus.down = False
    assert await other.publish_pending() == 0
    assert await writer.publish_pending() == 1
    assert published_states(bus) == ["fast", "orphan", "retried"]
    assert await writer.pending() == 0


async def test_published_rows_are_pruned_after_the_keep_time_and_nothing_else(database: Database):
    """Published rows older than keep_published_s go; recent and unpublished rows stay."""
    from datetime import timedelta

    from sqlalchemy import update

    from temper.clock import utcnow

    async with database.session() as s:
        for n in range(7):
            enqueue(s, "events", event(n))
    async with database.session() as s:
        ids = sorted((await s.scalars(select(OutboxRow.id))).all())
        old, recent = ids[:3], ids[3:5]  # the last two stay unpublished
        now = utcnow()
        await s.execute(
            update(OutboxRow).where(OutboxRow.id.in_(old)).values(published_at=now - timedelta(hours=2))
        )
        await s.execute(
            update(OutboxRow).where(OutboxRow.id.in_(recent)).values(published_at=now - timedelta(minutes=5))
        )
    relay = OutboxRelay(database, InProcessBus(partitions=1), keep_published_s=3600)
    assert await relay.prune_published(batch=2) == 3  # in batches smaller than the work
    async with database.session() as s:
        left = sorted((await s.scalars(select(OutboxRow.id))).all())
    assert left == ids[3:]
    assert await relay.pending() == 2
    assert await relay.prune_published() == 0
