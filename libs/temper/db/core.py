"""Transactions of SQLAlchemy Core statements, run on the driver where that is cheaper.

The dispatcher's hot path (docs/episodes.md) reads and writes with Core statements built
once and no ORM. Run through SQLAlchemy's async engine, each statement costs about 100 µs
of Python (cache key, execution context, parameter and row processing, a greenlet switch)
and each transaction about 300 µs more (the pool's checkout, BEGIN and COMMIT through the
async adapter): more than all the rest of a result's handling. So :class:`CoreTx` has two
executors of the same statements:

- :class:`DriverTx` (Postgres): each statement is compiled once by SQLAlchemy's own
  asyncpg dialect (the same SQL SQLAlchemy would send) and run as an asyncpg prepared
  statement on a connection of a small pool of the database's own, with the statement's
  bind and result processing taken from its column types, and its Python-side defaults
  (``default=``, ``onupdate=``) filled in as SQLAlchemy fills them. A transaction is
  asyncpg's own BEGIN and COMMIT. Rows of one table are inserted with one ``INSERT ...
  SELECT FROM unnest(...)`` and updated with one pipelined ``executemany``.
- :class:`SessionTx` (SQLite, and a transaction an ORM session already holds): the same
  statements through SQLAlchemy.

Either way the statements, the row type (``temper.db.rows``) and the rules over it
(``temper.lifecycle``) are one; only who sends the SQL differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import asyncpg
from sqlalchemy import Table, bindparam, insert, or_, update
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.sql import ClauseElement, ColumnElement
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Update

from temper.db import jsontext

Row = tuple[Any, ...]
Params = Mapping[str, Any]


class CoreTx:
    """One transaction for Core statements. ``info`` holds what ``temper.outbox.enqueue``
    and ``temper.db.rows.stage`` leave on it (as an ORM session's ``info`` does)."""

    info: dict[str, Any]
    dialect: str  # "postgresql" or "sqlite"

    async def rows(self, stmt: Executable, params: Params | None = None) -> list[Row]:
        """The rows ``stmt`` returns."""
        raise NotImplementedError

    async def run(self, stmt: Executable, params: Params | Sequence[Params] | None = None) -> None:
        """Execute ``stmt`` once, or once per mapping of a list (one round trip)."""
        raise NotImplementedError

    async def insert_many(
        self, table: Table, names: frozenset[str], values: list[dict[str, Any]]
    ) -> list[Row]:
        """Insert ``values`` (each holding the columns ``names``) into ``table`` in one
        statement; returns each row's autoincrement primary key, in the order of
        ``values``, when the table has one the rows lack (else an empty list)."""
        raise NotImplementedError

    async def write_many(self, inserts: Sequence[Rows], updates: Sequence[Rows]) -> list[list[Row]]:
        """Insert the rows of ``inserts`` (as :meth:`insert_many`, in the order given) and
        update those of ``updates`` (each row holds its table's primary key and the
        columns ``names``, which it sets); returns each insert's keys. Here a statement per
        table and set of columns; on the driver all of them are one statement."""
        keys = [await self.insert_many(table, names, values) for table, names, values in inserts]
        for table, names, values in updates:
            (pk,) = table.primary_key.columns
            await self.run(
                update_of(table, names),
                [{"row_pk": v[pk.key], **{f"set_{n}": v[n] for n in names}} for v in values],
            )
        return keys


# A table, a set of column keys, and rows holding them (``CoreTx.write_many``).
Rows = tuple[Table, frozenset[str], list[dict[str, Any]]]
_UPDATES: dict[tuple[str, frozenset[str]], Update] = {}


def update_of(table: Table, names: frozenset[str]) -> Update:
    """``UPDATE table SET <names> WHERE <primary key> = :row_pk``, built once per set
    (its values bound as ``set_<name>``)."""
    key = (table.name, names)
    stmt = _UPDATES.get(key)
    if stmt is None:
        (pk,) = table.primary_key.columns
        stmt = (
            update(table)
            .where(pk == bindparam("row_pk"))
            .values({table.c[c]: bindparam(f"set_{c}", type_=table.c[c].type) for c in sorted(names)})
        )
        _UPDATES[key] = stmt
    return stmt


def one_of(column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
    """``column IN (values)`` for a fixed list, as one bound literal per value (SQLAlchemy's
    ``in_`` of a list is an expanding parameter, written out at each execution)."""
    return or_(*(column == v for v in values))


def _auto_key(table: Table, names: frozenset[str]) -> list[Any]:
    return [c for c in table.primary_key.columns if c.autoincrement is True and c.key not in names]


class SessionTx(CoreTx):
    """Core statements through SQLAlchemy, on a session's (or a connection's) transaction."""

    _INSERTS: dict[tuple[str, frozenset[str], bool], Any] = {}

    def __init__(self, conn: AsyncConnection, info: dict[str, Any]) -> None:
        self.conn = conn
        self.info = info
        self.dialect = conn.dialect.name

    @classmethod
    async def of(cls, session: AsyncSession) -> SessionTx:
        return cls(await session.connection(), session.info)

    async def rows(self, stmt: Executable, params: Params | None = None) -> list[Row]:
        return [tuple(r) for r in await self.conn.execute(stmt, dict(params or {}))]

    async def run(self, stmt: Executable, params: Params | Sequence[Params] | None = None) -> None:
        if params is None or isinstance(params, Mapping):
            await self.conn.execute(stmt, dict(params or {}))
        elif params:
            await self.conn.execute(stmt, [dict(p) for p in params])

    async def insert_many(
        self, table: Table, names: frozenset[str], values: list[dict[str, Any]]
    ) -> list[Row]:
        # SQLAlchemy's sort_by_parameter_order runs one INSERT a row on SQLite. SQLite gives
        # each new row an integer key one above the largest, in VALUES order (Postgres's
        # sequence does the same: the driver path sorts too), so there the sorted keys of
        # one multi-row INSERT are the parameters' order.
        sqlite = self.dialect == "sqlite"
        key = (table.name, names, sqlite)
        stmt = self._INSERTS.get(key)
        if stmt is None:
            auto = _auto_key(table, names)
            stmt = insert(table)
            if auto:
                stmt = stmt.returning(*auto, sort_by_parameter_order=not sqlite)
            self._INSERTS[key] = stmt
        result = await self.conn.execute(stmt, values)
        if not stmt._returning:  # noqa: SLF001 - built here
            return []
        found = [tuple(r) for r in result]
        return sorted(found) if sqlite else found


# --- Postgres: the statements on asyncpg ---------------------------------------------------------

Processor = Callable[[Any], Any] | None


@dataclass(frozen=True)
class _Compiled:
    """A statement as asyncpg runs it: its SQL, where each positional value comes from
    (a parameter, a bound literal, or a Python-side default) and how values are processed."""

    sql: str
    names: tuple[str, ...]
    fixed: dict[str, Any]  # bound values the statement carries itself
    defaults: dict[str, Callable[[], Any]]  # Python-side defaults (insert default, onupdate)
    binds: tuple[Processor, ...]
    results: tuple[Processor, ...]
    keep: Executable  # the statement, so its id is not reused while cached

    def args(self, params: Params) -> list[Any]:
        out = []
        for name, process in zip(self.names, self.binds, strict=True):
            if name in params:
                value = params[name]
            elif name in self.fixed:
                value = self.fixed[name]
            elif name in self.defaults:
                value = self.defaults[name]()
            else:
                raise KeyError(f"no value for the statement's parameter {name!r}")
            out.append(process(value) if process is not None else value)
        return out

    def row(self, record: Sequence[Any]) -> Row:
        if not any(self.results):
            return tuple(record)
        return tuple(p(v) if p is not None else v for p, v in zip(self.results, record, strict=True))


def _default_of(column: Any, onupdate: bool) -> Callable[[], Any]:
    default = column.onupdate if onupdate else column.default
    if default is None or not (default.is_scalar or default.is_callable):
        raise ValueError(f"column {column} has no Python-side default to fill in")
    if default.is_scalar:
        value = default.arg
        return lambda: value
    fn = default.arg
    return lambda: fn(None)  # SQLAlchemy wraps a callable to take the execution context


def _result_processors(stmt: Executable, dialect: Dialect, oids: Sequence[int]) -> tuple[Processor, ...]:
    """Each result column's processor, as SQLAlchemy picks it: by the column's type and
    the type the server says it returns (``oids``, from the prepared statement)."""
    columns = list(getattr(stmt, "exported_columns", ()) or ())
    if len(columns) != len(oids):
        raise ValueError(f"the statement returns {len(oids)} columns, its Core form names {len(columns)}")
    return tuple(
        cast(ColumnElement[Any], c).type.dialect_impl(dialect).result_processor(dialect, oid)
        for c, oid in zip(columns, oids, strict=True)
    )


def _sql_of(stmt: Executable, dialect: Dialect) -> SQLCompiler:
    compiled = cast(SQLCompiler, cast(ClauseElement, stmt).compile(dialect=dialect))
    if "POSTCOMPILE" in compiled.string:  # SQLAlchemy writes IN (...) out at each execution
        raise ValueError(
            "IN of a list is not run on the driver: use = ANY(:array) on Postgres, "
            "or temper.db.core.one_of for a fixed list"
        )
    return compiled


def _compile(stmt: Executable, compiled: SQLCompiler, dialect: Dialect, oids: Sequence[int]) -> _Compiled:
    if compiled.positiontup is None:
        raise ValueError("the asyncpg dialect compiles positional statements")
    names = tuple(compiled.positiontup)
    fixed: dict[str, Any] = {}
    binds: list[Processor] = []
    for name in names:
        bind = compiled.binds[name]
        if bind.value is not None or bind.callable is not None:
            fixed[name] = bind.effective_value
        binds.append(bind.type.dialect_impl(dialect).bind_processor(dialect))
    defaults: dict[str, Callable[[], Any]] = {}
    for column in compiled.insert_prefetch:
        defaults[column.key] = _default_of(column, onupdate=False)
    for column in compiled.update_prefetch:
        defaults[column.key] = _default_of(column, onupdate=True)
    return _Compiled(
        compiled.string, names, fixed, defaults, tuple(binds), _result_processors(stmt, dialect, oids), stmt
    )


@dataclass(frozen=True)
class _BulkPart:
    """One table's rows as arrays, one per column, numbered from ``$first``:

    - an insert, ``INSERT INTO t (cols) SELECT ... FROM unnest($1::type[], ...) WITH
      ORDINALITY ... ORDER BY n``, RETURNING the autoincrement key in the rows' order (the
      rows are inserted in the order of ``WITH ORDINALITY``, so the sequence hands out
      ascending keys in that order, which is how SQLAlchemy's own
      ``sort_by_parameter_order`` sorts them);
    - an update, ``UPDATE t SET c = u.c ... FROM unnest($1::pk_type[], ...) AS u WHERE
      t.pk = u.pk``: each row's columns set by its primary key.

    Columns the rows lack that have a Python-side default (``default=`` for an insert,
    ``onupdate=`` for an update) are filled in as SQLAlchemy fills them."""

    sql: str
    columns: tuple[str, ...]  # the value columns, in array order
    defaults: dict[str, Callable[[], Any]]
    binds: tuple[Processor, ...]
    returning: bool

    def arrays(self, values: list[dict[str, Any]]) -> list[list[Any]]:
        out: list[list[Any]] = []
        for column, process in zip(self.columns, self.binds, strict=True):
            default = self.defaults.get(column)
            column_values = [v[column] for v in values] if default is None else [default() for _ in values]
            out.append([process(x) for x in column_values] if process is not None else column_values)
        return out


def _bulk_part(
    table: Table, names: frozenset[str], dialect: Dialect, *, insert: bool, first: int = 1
) -> _BulkPart:
    auto = _auto_key(table, names) if insert else []
    pk = None if insert else next(iter(table.primary_key.columns))
    columns: list[str] = [] if pk is None else [pk.key]  # an update finds its rows by the first array
    defaults: dict[str, Callable[[], Any]] = {}
    for column in table.columns:
        default = column.default if insert else column.onupdate
        if column is pk:
            continue
        if column.key in names:
            columns.append(column.key)
        elif column in auto or default is None:
            continue
        else:  # filled in from its Python-side default, as SQLAlchemy's INSERT and UPDATE do
            columns.append(column.key)
            defaults[column.key] = _default_of(column, onupdate=not insert)
    q = dialect.identifier_preparer
    arrays = ", ".join(
        f"${first + i}::{table.c[c].type.compile(dialect=dialect)}[]" for i, c in enumerate(columns)
    )
    aliases = [f"c{i}" for i in range(len(columns))]
    target = q.format_table(table)
    if insert:
        quoted = ", ".join(q.quote(table.c[c].name) for c in columns)
        sql = (
            f"INSERT INTO {target} ({quoted}) SELECT {', '.join(aliases)} "
            f"FROM unnest({arrays}) WITH ORDINALITY AS u({', '.join(aliases)}, n) ORDER BY n"
        )
        if auto:
            sql += " RETURNING " + ", ".join(q.quote(c.name) for c in auto)
    else:
        assert pk is not None
        sets = ", ".join(
            f"{q.quote(table.c[c].name)} = u.{a}" for c, a in zip(columns[1:], aliases[1:], strict=True)
        )
        sql = (
            f"UPDATE {target} SET {sets} FROM unnest({arrays}) AS u({', '.join(aliases)}) "
            f"WHERE {target}.{q.quote(pk.name)} = u.c0"
        )
    binds = tuple(table.c[c].type.dialect_impl(dialect).bind_processor(dialect) for c in columns)
    return _BulkPart(sql, tuple(columns), defaults, binds, bool(auto))


@dataclass(frozen=True)
class _Combined:
    """Several bulk parts as one statement: each a data-modifying ``WITH`` query, which
    Postgres runs once and to completion whether or not the main query reads it; the main
    query gives the inserted keys, each tagged with its insert. One round trip for every
    write of a transaction (``CoreTx.write_many``)."""

    sql: str
    inserts: tuple[_BulkPart, ...]
    updates: tuple[_BulkPart, ...]


def _combined(
    inserts: Sequence[tuple[Table, frozenset[str]]],
    updates: Sequence[tuple[Table, frozenset[str]]],
    dialect: Dialect,
) -> _Combined:
    parts: list[str] = []
    built: list[list[_BulkPart]] = [[], []]
    first = 1
    for kind, group in enumerate((inserts, updates)):
        for table, names in group:
            part = _bulk_part(table, names, dialect, insert=kind == 0, first=first)
            first += len(part.columns)
            built[kind].append(part)
            parts.append(f"w{len(parts)} AS ({part.sql})")
    # the inserts are the first parts, so insert i is w<i>; its keys come back tagged i
    keyed = [f"SELECT {i}, * FROM w{i}" for i, part in enumerate(built[0]) if part.returning]
    main = " UNION ALL ".join(keyed) if keyed else "SELECT 0 WHERE false"
    return _Combined(f"WITH {', '.join(parts)} {main}", tuple(built[0]), tuple(built[1]))


class Statements:
    """The compiled forms of the statements one database runs on asyncpg (each compiled
    on first use, then kept: the statements are module constants built once)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._compiled: dict[int, _Compiled] = {}
        self._inserts: dict[tuple[str, frozenset[str]], _BulkPart] = {}
        self._combined: dict[tuple[tuple[tuple[str, frozenset[str]], ...], ...], _Combined] = {}

    async def compiled(self, stmt: Executable, conn: asyncpg.Connection) -> _Compiled:
        found = self._compiled.get(id(stmt))
        if found is None or found.keep is not stmt:
            compiled = _sql_of(stmt, self.dialect)
            if "POSTCOMPILE" in compiled.string:
                raise ValueError(
                    "expanding parameters are not run on the driver: use = ANY(:array) on Postgres"
                )
            oids = [a.type.oid for a in (await conn.prepare(compiled.string)).get_attributes()]
            found = self._compiled[id(stmt)] = _compile(stmt, compiled, self.dialect, oids)
        return found

    def bulk_insert(self, table: Table, names: frozenset[str]) -> _BulkPart:
        key = (table.name, names)
        found = self._inserts.get(key)
        if found is None:
            found = self._inserts[key] = _bulk_part(table, names, self.dialect, insert=True)
        return found

    def combined(self, inserts: Sequence[Rows], updates: Sequence[Rows]) -> _Combined:
        key = (tuple((t.name, n) for t, n, _ in inserts), tuple((t.name, n) for t, n, _ in updates))
        found = self._combined.get(key)
        if found is None:
            found = self._combined[key] = _combined(
                [(t, n) for t, n, _ in inserts], [(t, n) for t, n, _ in updates], self.dialect
            )
        return found


class DriverTx(CoreTx):
    """Core statements on an asyncpg connection inside its transaction."""

    def __init__(self, conn: asyncpg.Connection, statements: Statements) -> None:
        self.conn = conn
        self.statements = statements
        self.info = {}
        self.dialect = "postgresql"

    async def rows(self, stmt: Executable, params: Params | None = None) -> list[Row]:
        c = await self.statements.compiled(stmt, self.conn)
        return [c.row(r) for r in await self.conn.fetch(c.sql, *c.args(params or {}))]

    async def run(self, stmt: Executable, params: Params | Sequence[Params] | None = None) -> None:
        c = await self.statements.compiled(stmt, self.conn)
        if params is None or isinstance(params, Mapping):
            await self.conn.execute(c.sql, *c.args(params or {}))
        elif params:
            await self.conn.executemany(c.sql, [c.args(p) for p in params])

    async def insert_many(
        self, table: Table, names: frozenset[str], values: list[dict[str, Any]]
    ) -> list[Row]:
        bulk = self.statements.bulk_insert(table, names)
        if not bulk.returning:
            await self.conn.execute(bulk.sql, *bulk.arrays(values))
            return []
        return sorted(tuple(r) for r in await self.conn.fetch(bulk.sql, *bulk.arrays(values)))

    async def write_many(self, inserts: Sequence[Rows], updates: Sequence[Rows]) -> list[list[Row]]:
        if len(inserts) + len(updates) < 2:
            return await super().write_many(inserts, updates)
        combined = self.statements.combined(inserts, updates)
        args: list[list[Any]] = []
        for part, (_, _, values) in zip(
            (*combined.inserts, *combined.updates), (*inserts, *updates), strict=True
        ):
            args.extend(part.arrays(values))
        keys: list[list[Row]] = [[] for _ in inserts]
        for record in await self.conn.fetch(combined.sql, *args):
            keys[record[0]].append(tuple(record[1:]))
        return [sorted(k) for k in keys]


async def reset_connection(conn: asyncpg.Connection) -> None:
    """What the driver pool runs on a connection given back, after asyncpg's own rollback
    of a transaction left open: nothing. asyncpg's default also closes cursors, drops
    listeners, resets settings and advisory locks, one more round trip per transaction,
    for session state these transactions never take."""


async def init_connection(conn: asyncpg.Connection) -> None:
    """JSON as SQLAlchemy's asyncpg dialect sends and reads it (its bind processor writes the
    text; the codec decodes), so both executors read and write the same values."""
    await conn.set_type_codec(
        "json",
        encoder=str.encode,
        decoder=jsontext.loads,
        schema="pg_catalog",
        format="binary",
    )


async def core_of(tx: CoreTx | AsyncSession) -> CoreTx:
    """``tx`` itself, or a session's transaction as a ``CoreTx``."""
    return await SessionTx.of(tx) if isinstance(tx, AsyncSession) else tx
