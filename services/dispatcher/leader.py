"""One scheduler leader per job across dispatcher replicas.

On Postgres a replica leads a job while it holds the session-level advisory lock
``pg_try_advisory_lock(hash(job id))`` on a dedicated connection; the lock goes away
with the connection, so a replica killed with SIGKILL hands its jobs over as soon as
Postgres notices the dropped socket. On SQLite (one machine, embedded) a lock table in
the process is enough.
"""

from __future__ import annotations

import hashlib
import logging

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from temper.db import Database
from temper.logs import log_event

log = logging.getLogger("temper.dispatcher.leader")

# SQLite: job ids led by some Leadership in this process, per database URL.
_LOCAL: dict[str, set[str]] = {}


def lock_key(job_id: str) -> int:
    """A stable signed 64-bit key for ``pg_try_advisory_lock``."""
    return int.from_bytes(
        hashlib.blake2b(f"temper-job:{job_id}".encode(), digest_size=8).digest(), "big", signed=True
    )


class Leadership:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.held: set[str] = set()
        self._conn: AsyncConnection | None = None

    async def _connection(self) -> AsyncConnection:
        if self._conn is not None:
            try:
                await self._conn.execute(text("SELECT 1"))
                return self._conn
            except Exception as exc:  # noqa: BLE001 - any failure means the locks are gone
                log_event(
                    log, "leadership connection lost", logging.WARNING, error=repr(exc), jobs=len(self.held)
                )
                self.held.clear()
                await self._drop()
        conn = await self.db.engine.connect()
        self._conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    async def _drop(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except Exception:  # noqa: BLE001, S110 - closing a dead connection
                pass
            self._conn = None

    async def acquire(self, job_id: str) -> bool:
        """True if this replica leads ``job_id`` (now or already)."""
        if self.db.is_sqlite:
            holders = _LOCAL.setdefault(self.db.url, set())
            if job_id in self.held:
                return True
            if job_id in holders:
                return False
            holders.add(job_id)
            self.held.add(job_id)
            return True
        conn = await self._connection()
        if job_id in self.held:
            return True
        got = bool(await conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": lock_key(job_id)}))
        if got:
            self.held.add(job_id)
            log_event(log, "leading job", job_id=job_id)
        return got

    async def release(self, job_id: str) -> None:
        if job_id not in self.held:
            return
        self.held.discard(job_id)
        if self.db.is_sqlite:
            _LOCAL.get(self.db.url, set()).discard(job_id)
            return
        if self._conn is not None:
            try:
                await self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": lock_key(job_id)})
            except Exception:  # noqa: BLE001 - a lost connection released it anyway
                await self._drop()

    async def close(self) -> None:
        for job_id in list(self.held):
            await self.release(job_id)
        await self._drop()
