"""Transactional outbox: a command is written as a row in the same transaction as the
state change that caused it, and is published only once that transaction committed.

Every row has exactly one relay at a time, from its send to its mark, so a command
goes to the bus once (a crash between send and mark is the only way to send it twice):

- the fast path: :meth:`OutboxRelay.transaction` writes its rows with ``claimed_until``
  set ``claim_s`` ahead, publishes them right after the commit, and marks them sent on
  the relay's next pass. Until the claim runs out no other relay touches them;
- the sweep: :meth:`OutboxRelay.publish_pending` publishes, in id order, committed rows
  that are unclaimed (written outside ``transaction()``, e.g. by the trainer) or whose
  claim ran out (the writer died between commit and send, or could not send), and marks
  them in the same transaction. On Postgres it locks the rows it takes
  (``FOR UPDATE SKIP LOCKED``), so relays in several processes never take the same row;
  its own fast path's rows whose send failed it takes back at once.

SQLite has no ``SKIP LOCKED``: the embedded mode runs one process with one relay, and
the claim only has to keep its sweep off the rows its fast path is sending.

A rolled-back transaction leaves no row, so nothing is published for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar, cast

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from temper import metrics
from temper.bus import Bus
from temper.bus.errors import unavailable_dependency
from temper.clock import utcnow
from temper.db import Database, OutboxRow
from temper.db import rows as rows_of_db
from temper.db.core import CoreTx
from temper.db.rows import HasInfo
from temper.events import Message
from temper.logs import dependency_failed, dependency_recovered, log_event

log = logging.getLogger("temper.outbox")

Tx = TypeVar("Tx", AsyncSession, CoreTx)  # a relay's transaction: an ORM session or Core
# The rows a session added to the outbox, for the fast path (session.info is per session).
_ROWS = "temper.outbox.rows"
# Set on a relay's transaction(): the relay stages its rows claimed, not enqueue().
_RELAYED = "temper.outbox.relayed"


def enqueue(tx: HasInfo, topic: str, message: Message) -> None:
    """Add ``message`` to the outbox inside the caller's transaction (an ORM session or a
    ``temper.db.core.CoreTx``). In a relay's transaction the relay stages it claimed
    before the commit; in any other the row is written with the transaction's own rows
    (a session flushes it; a ``CoreTx`` writes what is staged on it)."""
    row = rows_of_db.new(OutboxRow, topic=topic, key=message.key(), payload=message.to_bytes())
    if not tx.info.get(_RELAYED):
        if isinstance(tx, AsyncSession):
            tx.add(row)
        else:
            rows_of_db.stage(tx, row)
    tx.info.setdefault(_ROWS, []).append(row)


class OutboxRelay:
    # After a pass that found nothing, the sweep waits this long unless notify() wakes it.
    IDLE_WAIT_S = 0.25

    def __init__(
        self,
        db: Database,
        bus: Bus,
        *,
        batch: int = 200,
        idle_sleep_s: float = 0.02,
        after_publish: Callable[[list[int]], Awaitable[None]] | None = None,
        claim_s: float = 30.0,
        keep_published_s: float = 3600.0,
        prune_every_s: float = 60.0,
    ) -> None:
        self.db = db
        # Published rows would otherwise stay forever (docs/capacity.md): each relay deletes
        # those published more than keep_published_s ago, every prune_every_s.
        self.keep_published_s = keep_published_s
        self.prune_every_s = prune_every_s
        self._pruned_at = time.monotonic()
        self.bus = bus
        self.batch = batch
        self.idle_sleep_s = idle_sleep_s
        self._after_publish = after_publish  # a test hook: runs between publishing and marking
        self._wake = asyncio.Event()
        self._claimed: set[int] = set()  # rows the fast path is publishing: the sweep leaves them
        self._sent: list[int] = []  # rows the fast path published, to be marked by the next pass
        self._failed: set[int] = set()  # rows the fast path could not send: this sweep takes them back
        self.claim_s = claim_s
        self._down: set[str] = set()  # dependencies whose outage this relay reported

    def notify(self) -> None:
        """Tell the relay that rows were just committed (skips the idle sleep)."""
        self._wake.set()

    def transaction(self) -> AbstractAsyncContextManager[AsyncSession]:
        """An ORM session's transaction whose outbox rows are published as soon as it commits."""
        return self._relayed(self.db.session())

    def core(self) -> AbstractAsyncContextManager[CoreTx]:
        """:meth:`transaction` for Core statements only (``Database.core``)."""
        return self._relayed(self.db.core())

    @asynccontextmanager
    async def _relayed(self, opened: AbstractAsyncContextManager[Tx]) -> AsyncIterator[Tx]:
        async with opened as tx:
            tx.info[_RELAYED] = True
            yield tx
            rows: list[OutboxRow] = tx.info.pop(_ROWS, [])
            self._stage_claimed(tx, rows)
        await self._publish_committed(rows)

    def _stage_claimed(self, tx: HasInfo, rows: list[OutboxRow]) -> None:
        """Stage ``rows`` claimed by this relay for ``claim_s``, to be written with the
        transaction's other rows before it commits (``temper.db.rows.write``: in one
        statement, in the order they were enqueued, so the sweep's id order is the enqueue
        order; on Postgres together with every other write of the transaction). The sweep
        cannot see them before the commit, and after it their claim keeps it off them."""
        created = utcnow()
        until = created + timedelta(seconds=self.claim_s)
        for row in rows:
            row.created_at = created
            row.claimed_until = until
        rows_of_db.stage(tx, *rows)

    async def _publish_committed(self, rows: Sequence[OutboxRow]) -> None:
        if not rows:
            return
        ids = {r.id for r in rows}
        self._claimed |= ids
        try:
            await self._send(rows)
        except Exception as exc:  # noqa: BLE001 - the rows are committed: the sweep sends them
            self._report(exc, "publish after commit failed; the relay will retry")
            self._failed |= ids
            self._wake.set()  # the sweep sends them now
        else:
            self._sent.extend(ids)  # marked by the next pass, not urgent: no wake-up
        finally:
            self._claimed -= ids

    def _report(self, exc: BaseException, message: str) -> None:
        dependency = unavailable_dependency(exc)
        if dependency is None:
            log_event(log, message, logging.WARNING, error=repr(exc))
        else:  # an outage: logged once, then at a bounded rate
            self._down.add(dependency)
            dependency_failed(log, dependency, exc, waiting=message)

    async def _send(self, rows: Sequence[OutboxRow]) -> None:
        # All in flight together: the producer keeps call order per partition (and so per key).
        await asyncio.gather(*(self.bus.send(r.topic, r.payload, key=r.key) for r in rows))
        for row in rows:
            metrics.OUTBOX_PUBLISHED.labels(row.topic).inc()

    async def publish_pending(self) -> int:
        """Mark what the fast path sent, then publish one batch of committed rows that
        nobody published, in id order; returns how many of those."""
        sent, self._sent = self._sent, []
        try:
            async with self.db.session() as session:
                if sent:
                    await session.execute(
                        update(OutboxRow).where(OutboxRow.id.in_(sent)).values(published_at=utcnow())
                    )
                failed = set(self._failed)
                claimable = or_(OutboxRow.claimed_until.is_(None), OutboxRow.claimed_until < utcnow())
                if failed:
                    claimable = or_(claimable, OutboxRow.id.in_(failed))
                query = (
                    select(OutboxRow)
                    .where(OutboxRow.published_at.is_(None), claimable)
                    .order_by(OutboxRow.id)
                    .limit(self.batch)
                )
                if not self.db.is_sqlite:
                    query = query.with_for_update(skip_locked=True)
                found = list((await session.execute(query)).scalars())
                # Leave this process's fast path its rows: in flight, or sent and not yet marked.
                fast = self._claimed | set(self._sent)
                rows = [r for r in found if r.id not in fast]
                await self._send(rows)
                ids = [r.id for r in rows]
                if self._after_publish is not None:
                    await self._after_publish(ids)
                if ids:
                    await session.execute(
                        update(OutboxRow).where(OutboxRow.id.in_(ids)).values(published_at=utcnow())
                    )
            # Taken back (or, if the batch was not full, published by another relay already).
            self._failed -= failed if len(found) < self.batch else set(ids)
        except BaseException:
            self._sent[:0] = sent  # not marked: try again next pass (they are not re-sent)
            raise
        return len(rows)

    async def prune_published(self, batch: int = 5000) -> int:
        """Delete rows published more than ``keep_published_s`` ago, ``batch`` at a time
        (short transactions; relays in other processes may prune at the same moment, and
        a row deleted twice is simply not there the second time)."""
        cutoff = utcnow() - timedelta(seconds=self.keep_published_s)
        deleted = 0
        while True:
            async with self.db.session() as session:
                ids = select(OutboxRow.id).where(OutboxRow.published_at < cutoff).limit(batch)
                # a DELETE's result is a CursorResult, which has the row count
                result = cast(
                    CursorResult[Any], await session.execute(delete(OutboxRow).where(OutboxRow.id.in_(ids)))
                )
            n = result.rowcount or 0
            deleted += n
            if n < batch:
                break
        if deleted:
            metrics.OUTBOX_PRUNED.inc(deleted)
        return deleted

    async def pending(self) -> int:
        async with self.db.session() as session:
            count = await session.scalar(
                select(func.count()).select_from(OutboxRow).where(OutboxRow.published_at.is_(None))
            )
        metrics.OUTBOX_PENDING.set(count or 0)
        return count or 0

    async def run(self, until: asyncio.Event | None = None) -> None:
        """Publish until ``until`` is set (forever without one); errors are logged and
        retried, never fatal. Setting ``until`` (then :meth:`notify`) ends the loop after its
        current pass, so no query is cancelled half-way."""
        while until is None or not until.is_set():
            try:
                published = await self.publish_pending()
                if time.monotonic() - self._pruned_at >= self.prune_every_s:
                    self._pruned_at = time.monotonic()
                    await self.prune_published()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the relay must outlive a bus or db blip
                self._report(exc, "outbox relay pass failed")
                published = 0
                await asyncio.sleep(1)
            else:
                for dependency in self._down:
                    dependency_recovered(log, dependency)
                self._down.clear()
            if published < self.batch:
                try:
                    await asyncio.wait_for(
                        self._wake.wait(), self.idle_sleep_s if published else self.IDLE_WAIT_S
                    )
                except TimeoutError:
                    pass
                self._wake.clear()
