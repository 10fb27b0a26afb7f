"""Transactional outbox: a command is written as a row in the same transaction as the
state change that caused it, and a relay publishes committed rows in order.

A rolled-back transaction leaves no row, so nothing is published for it. A relay that
dies after publishing but before marking rows sent publishes them again on restart:
delivery is at-least-once and every consumer is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from temper import metrics
from temper.bus import Bus
from temper.db import Database, OutboxRow
from temper.db.models import utcnow
from temper.events import Message
from temper.logs import log_event

log = logging.getLogger("temper.outbox")


def enqueue(session: AsyncSession, topic: str, message: Message) -> None:
    """Add ``message`` to the outbox inside the caller's transaction."""
    session.add(OutboxRow(topic=topic, key=message.key(), payload=message.to_bytes()))


class OutboxRelay:
    def __init__(
        self,
        db: Database,
        bus: Bus,
        *,
        batch: int = 200,
        idle_sleep_s: float = 0.02,
        after_publish: Callable[[list[int]], Awaitable[None]] | None = None,
    ) -> None:
        self.db = db
        self.bus = bus
        self.batch = batch
        self.idle_sleep_s = idle_sleep_s
        self._after_publish = after_publish  # a test hook: runs between publishing and marking
        self._wake = asyncio.Event()

    def notify(self) -> None:
        """Tell the relay that rows were just committed (skips the idle sleep)."""
        self._wake.set()

    async def publish_pending(self) -> int:
        """Publish one batch of committed rows in id order; returns how many."""
        async with self.db.session() as session:
            query = select(OutboxRow).where(OutboxRow.published_at.is_(None)).order_by(OutboxRow.id).limit(self.batch)
            if not self.db.is_sqlite:
                query = query.with_for_update(skip_locked=True)
            rows = list((await session.execute(query)).scalars())
            for row in rows:
                await self.bus.send(row.topic, row.payload, key=row.key)
                metrics.OUTBOX_PUBLISHED.labels(row.topic).inc()
            ids = [r.id for r in rows]
            if self._after_publish is not None:
                await self._after_publish(ids)
            if ids:
                await session.execute(update(OutboxRow).where(OutboxRow.id.in_(ids)).values(published_at=utcnow()))
        return len(rows)

    async def pending(self) -> int:
        async with self.db.session() as session:
            count = await session.scalar(
                select(func.count()).select_from(OutboxRow).where(OutboxRow.published_at.is_(None))
            )
        metrics.OUTBOX_PENDING.set(count or 0)
        return count or 0

    async def run(self) -> None:
        """Publish forever; errors are logged and retried, never fatal."""
        while True:
            try:
                published = await self.publish_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the relay must outlive a bus or db blip
                log_event(log, "outbox relay pass failed", logging.WARNING, error=repr(exc))
                published = 0
                await asyncio.sleep(1)
            if published < self.batch:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.idle_sleep_s if published else 0.25)
                except TimeoutError:
                    pass
                self._wake.clear()
