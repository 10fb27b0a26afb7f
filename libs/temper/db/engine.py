from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from sqlalchemy import event, text
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from temper.db import jsontext
from temper.db.core import CoreTx, DriverTx, SessionTx, Statements, init_connection, reset_connection
from temper.db.rows import write_staged
from temper.settings import DatabaseSettings


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached; the message names the setting to check."""


def masked_url(url: str) -> str:
    return re.sub(r"(://[^:/@]+:)[^@]+@", r"\1***@", url)


# Connections of the driver's own pool (Postgres), beside the engine's: the dispatcher's
# result transactions (at most two at a time), the reaper's and the archive's.
DRIVER_POOL_SIZE = 4


class Database:
    """An engine plus a session factory. ``session()`` opens a transaction that commits
    when the block ends (after writing the rows staged on it) and rolls back if it raises;
    ``core()`` is one for Core statements only (``temper.db.core``), straight on asyncpg on
    Postgres."""

    def __init__(self, settings: DatabaseSettings) -> None:
        self.url = settings.url
        kwargs: dict = {
            "echo": settings.echo,
            "json_serializer": jsontext.dumps,
            "json_deserializer": jsontext.loads,
        }
        if settings.is_sqlite:
            self._ensure_sqlite_dir(settings.url)
            kwargs["connect_args"] = {"timeout": 30}
        else:
            kwargs.update(pool_size=settings.pool_size)
        self.engine: AsyncEngine = create_async_engine(settings.url, **kwargs)
        if settings.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            pool = self.engine.sync_engine.pool
            event.listen(pool, "checkin", _idle_from_now)
            event.listen(pool, "checkout", _ping_if_idle)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._driver_pool: asyncpg.Pool | None = None
        self._driver_lock = asyncio.Lock()
        self._statements = Statements(self.engine.dialect)
        self.driver_pool_size = min(DRIVER_POOL_SIZE, settings.pool_size)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @staticmethod
    def _ensure_sqlite_dir(url: str) -> None:
        from pathlib import Path

        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A transaction; the rows staged on it (``temper.db.rows.stage``) are written
        before it commits."""
        async with self.sessions() as session, session.begin():
            yield session
            await write_staged(session)

    @asynccontextmanager
    async def core(self) -> AsyncIterator[CoreTx]:
        """A transaction for Core statements (``temper.db.core``): on Postgres an asyncpg
        one on the driver's own pool, elsewhere a session's. The rows staged on it are
        written before it commits."""
        if self.is_sqlite:
            async with self.session() as session:
                yield await SessionTx.of(session)
            return
        pool = self._driver_pool or await self._start_driver_pool()
        async with pool.acquire() as conn, conn.transaction():
            tx = DriverTx(conn, self._statements)
            yield tx
            await write_staged(tx)

    async def _start_driver_pool(self) -> asyncpg.Pool:
        async with self._driver_lock:
            if self._driver_pool is None:
                _, opts = self.engine.dialect.create_connect_args(self.engine.url)
                args: dict[str, Any] = {
                    k: v
                    for k, v in opts.items()
                    if k not in ("prepared_statement_cache_size", "async_fallback")
                }
                self._driver_pool = await asyncpg.create_pool(
                    min_size=0,
                    max_size=self.driver_pool_size,
                    init=init_connection,
                    reset=reset_connection,
                    **args,
                )
            return self._driver_pool

    async def check(self) -> None:
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as exc:  # noqa: BLE001 - every driver error means the same to the caller
            raise DatabaseUnavailable(
                f"cannot connect to the database at TEMPER_DB__URL={masked_url(self.url)}: "
                f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None

    async def dispose(self) -> None:
        if self._driver_pool is not None:
            pool, self._driver_pool = self._driver_pool, None
            await pool.close()
        await self.engine.dispose()


# A connection that sat in the pool longer than this is pinged before it is handed out.
# SQLAlchemy's pool_pre_ping pings on every checkout, which on asyncpg is three round
# trips (BEGIN, the ping, ROLLBACK) before each transaction: as many as the dispatcher's
# whole result handling. A connection used a moment ago is almost surely alive; if the
# server went away in that moment, the first statement fails with a disconnect error,
# SQLAlchemy invalidates the pool, and callers see the outage they would see anyway (the
# bus retries the record, temper.bus.errors.unavailable_dependency).
PING_IDLE_S = 1.0
_IDLE_SINCE = "temper.idle_since"


def _idle_from_now(_dbapi_conn: object, record: ConnectionPoolEntry) -> None:
    record.info[_IDLE_SINCE] = time.monotonic()


def _ping_if_idle(dbapi_conn: object, record: ConnectionPoolEntry, _proxy: object) -> None:
    since = record.info.pop(_IDLE_SINCE, None)
    if since is None or time.monotonic() - since < PING_IDLE_S:
        return  # just connected, or in use a moment ago
    try:
        dbapi_conn.ping()  # type: ignore[attr-defined]  # the asyncpg adapter's, as pool_pre_ping uses
    except Exception as exc:  # noqa: BLE001 - any failure: the pool replaces the connection and retries
        raise DisconnectionError(f"pooled connection failed its ping: {exc!r}") from exc


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
