"""The dispatcher's outbox relay: :class:`temper.outbox.OutboxRelay` with the sends of a
batch in flight together instead of one acknowledgement at a time.

Order per key is kept: the producer enqueues sends in call order and Kafka's idempotent
producer keeps that order within a partition (the in-process bus appends in call order).
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select, update
from temper import metrics
from temper.db import OutboxRow
from temper.db.models import utcnow
from temper.outbox import OutboxRelay


class ConcurrentRelay(OutboxRelay):
    async def publish_pending(self) -> int:
        async with self.db.session() as session:
            query = select(OutboxRow).where(OutboxRow.published_at.is_(None)).order_by(OutboxRow.id).limit(self.batch)
            if not self.db.is_sqlite:
                query = query.with_for_update(skip_locked=True)
            rows = list((await session.execute(query)).scalars())
            if not rows:
                return 0
            await asyncio.gather(*(self.bus.send(r.topic, r.payload, key=r.key) for r in rows))
            for row in rows:
                metrics.OUTBOX_PUBLISHED.labels(row.topic).inc()
            ids = [r.id for r in rows]
            if self._after_publish is not None:
                await self._after_publish(ids)
            await session.execute(update(OutboxRow).where(OutboxRow.id.in_(ids)).values(published_at=utcnow()))
        return len(rows)
