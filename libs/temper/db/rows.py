"""Rows read and written with SQLAlchemy Core, held as instances of their mapped class.

The dispatcher's hot path reads episodes and steps with one Core query per fetched batch
and writes what changed with one statement per table and set of columns, without the
ORM's unit of work (its identity map, flush ordering and per-object bookkeeping cost more
than the rest of a result's handling). The rows stay instances of the classes in
``models.py`` (``Episode``, ``Step``, ...), so there is one row type and the columns are
declared once; ``temper.lifecycle`` applies its rules to them whichever way they were
read.

- :func:`loaded` makes a detached instance from a row a Core query returned. Attribute
  changes are tracked by SQLAlchemy's own instrumentation, as on any mapped instance.
  Columns the query left out are not loaded: reading one raises
  (``DetachedInstanceError``) instead of quietly giving ``None``, and :func:`load` reads
  it when a rare path needs it.
- An instance made with its constructor (``Step(...)``, ``Episode(...)``) is new.
- :func:`write` inserts the new ones and updates the changed columns of the loaded ones
  in the caller's transaction: one statement per table and set of columns, executed for
  every row of the set at once, so a batch of results costs about as many statements as
  one (on Postgres all of them are one statement: ``CoreTx.write_many``). After it the
  rows count as written (nothing changed, none new). :func:`stage`
  leaves rows on a session for :func:`write_staged`, which the dispatcher's transactions
  run before they commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Table, bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstanceState, Mapper, configure_mappers
from sqlalchemy.orm.attributes import instance_state

from temper.db.core import CoreTx, SessionTx
from temper.db.models import Base

T = TypeVar("T", bound=Base)


def columns(cls: type[Base]) -> tuple[str, ...]:
    """Every column key of ``cls``'s table, in table order."""
    return tuple(c.key for c in _table(cls).columns)


def _table(cls: type[Base]) -> Table:
    return cast(Table, cls.__table__)


def loaded(cls: type[T], values: Mapping[str, Any]) -> T:
    """A detached ``cls`` holding ``values`` (a row read with Core, its primary key among
    them), with no change recorded: what the ORM would give back for the row and forget."""
    mapper: Mapper[T] = cls.__mapper__
    if not mapper.configured:  # the constructor would have configured it
        configure_mappers()
    obj = mapper.class_manager.new_instance()
    state: InstanceState[T] = instance_state(obj)
    state.dict.update(values)
    state.key = mapper.identity_key_from_primary_key(tuple(values[k] for k in _pk(cls)))
    missing = _keys(cls).difference(values)
    if missing:
        state.expired_attributes.update(missing)  # reading one on a detached row raises
    return obj


def new(cls: type[T], **values: Any) -> T:
    """A new ``cls`` row holding ``values``, as its constructor makes it (without the
    constructor's per-attribute events: a fifth of the cost); columns left out get their
    defaults when it is inserted."""
    mapper: Mapper[T] = cls.__mapper__
    if not mapper.configured:
        configure_mappers()
    obj = mapper.class_manager.new_instance()
    instance_state(obj).dict.update(values)
    return obj


_KEYS: dict[type[Base], frozenset[str]] = {}
_ORDER: dict[Table, int] = {}


def _table_order() -> dict[Table, int]:
    """Each table's place in the order its classes were declared (parents first)."""
    if len(_ORDER) != len(Base.metadata.tables):
        _ORDER.clear()
        _ORDER.update({t: i for i, t in enumerate(Base.metadata.sorted_tables)})
    return _ORDER


_PKS: dict[type[Base], tuple[str, ...]] = {}


def _pk(cls: type[Base]) -> tuple[str, ...]:
    """The primary key's column keys."""
    pk = _PKS.get(cls)
    if pk is None:
        pk = _PKS[cls] = tuple(c.key for c in _table(cls).primary_key.columns)
    return pk


def _keys(cls: type[Base]) -> frozenset[str]:
    keys = _KEYS.get(cls)
    if keys is None:
        keys = _KEYS[cls] = frozenset(columns(cls))
    return keys


def loaded_from(cls: type[T], keys: Sequence[str], values: Sequence[Any]) -> T | None:
    """:func:`loaded` from a slice of a Core row (``keys`` name its columns); ``None`` when
    its primary key is NULL (an outer join that matched nothing)."""
    row = dict(zip(keys, values, strict=True))
    if any(row.get(k) is None for k in _pk(cls)):
        return None
    return loaded(cls, row)


def loaded_columns(obj: Base) -> frozenset[str]:
    """The columns a row holds (a loaded row: those its query read)."""
    return frozenset(instance_state(obj).dict)


def is_new(obj: Base) -> bool:
    return instance_state(obj).key is None


def changed(obj: Base) -> dict[str, Any]:
    """The columns of a loaded row set since it was read (or written), with their values."""
    state = instance_state(obj)
    return {name: state.dict[name] for name in state.committed_state}


async def load(tx: CoreTx, obj: Base, *names: str) -> None:
    """Read the columns ``names`` of a loaded row that its query left out."""
    table = _table(type(obj))
    (pk,) = _pk(type(obj))
    key = (table.name, names)
    stmt = _LOADS.get(key)
    if stmt is None:
        stmt = _LOADS[key] = select(*(table.c[n] for n in names)).where(table.c[pk] == bindparam("row_pk"))
    (row,) = await tx.rows(stmt, {"row_pk": getattr(obj, pk)})
    instance_state(obj).dict.update(zip(names, row, strict=True))


_LOADS: dict[tuple[str, tuple[str, ...]], Any] = {}
_STAGED = "temper.db.rows.staged"


class HasInfo(Protocol):
    """A transaction that holds what is staged on it: an ORM session or a ``CoreTx``."""

    @property
    def info(self) -> dict[Any, Any]: ...


def stage(tx: HasInfo, *objs: Base | None) -> None:
    """Have :func:`write_staged` write ``objs`` before the transaction commits (the
    dispatcher's transactions do; code that makes rows need not hold on to them)."""
    tx.info.setdefault(_STAGED, []).extend(o for o in objs if o is not None)


async def write_staged(tx: CoreTx | AsyncSession) -> None:
    """:func:`write` the rows staged on ``tx`` since the last call."""
    staged = tx.info.pop(_STAGED, None)
    if staged:
        await write(await SessionTx.of(tx) if isinstance(tx, AsyncSession) else tx, staged)


def _grouped(changes: list[tuple[Base, dict[str, Any]]]) -> list[tuple[frozenset[str], list[Base]]]:
    """Rows of one table by the columns to write: every changed row that has every column
    any of them changed loaded is written with that union (its other values are the ones
    it read), so a batch whose rows changed different columns still takes one statement."""
    union = frozenset().union(*(c.keys() for _, c in changes))
    full = [obj for obj, _ in changes if union <= instance_state(obj).dict.keys()]
    groups: dict[frozenset[str], list[Base]] = {union: full} if full else {}
    taken = {id(obj) for obj in full}
    for obj, c in changes:
        if id(obj) not in taken:
            groups.setdefault(frozenset(c), []).append(obj)
    return list(groups.items())


async def write(tx: CoreTx, rows: Iterable[Base | None]) -> None:
    """Insert the new rows and update what changed on the loaded ones, in the caller's
    transaction. Tables are inserted in the order their classes were declared (a parent
    before the rows that refer to it), then updated."""
    inserts: dict[Table, dict[frozenset[str], list[Base]]] = {}
    updates: dict[Table, list[tuple[Base, dict[str, Any]]]] = {}
    seen: set[int] = set()
    for obj in rows:
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        table = _table(type(obj))
        state = instance_state(obj)
        if state.key is None:
            names = frozenset(state.dict.keys() & _keys(type(obj)))  # its columns (state holds others too)
            inserts.setdefault(table, {}).setdefault(names, []).append(obj)
        elif state.committed_state:
            updates.setdefault(table, []).append((obj, changed(obj)))
    order = _table_order()
    new_rows = [
        (table, names, objs)
        for table in sorted(inserts, key=order.__getitem__)
        for names, objs in inserts[table].items()
    ]
    changed_rows = [
        (table, names, objs) for table, changes in updates.items() for names, objs in _grouped(changes)
    ]
    returned = await tx.write_many(
        [
            (table, names, [{n: instance_state(o).dict[n] for n in names} for o in objs])
            for table, names, objs in new_rows
        ],
        [
            (table, names, [_with_key(_pk(type(objs[0])), instance_state(o).dict, names) for o in objs])
            for table, names, objs in changed_rows
        ],
    )
    for (table, names, objs), keys in zip(new_rows, returned, strict=True):
        auto = [c.key for c in table.primary_key.columns if c.key not in names] if keys else []
        for i, obj in enumerate(objs):
            state = instance_state(obj)
            if keys:
                state.dict.update(zip(auto, keys[i], strict=True))
            state.committed_state.clear()
            state.key = type(obj).__mapper__.identity_key_from_primary_key(
                tuple(state.dict[k] for k in _pk(type(obj)))
            )
    for _, _, objs in changed_rows:
        for obj in objs:
            instance_state(obj).committed_state.clear()


def _with_key(pk: tuple[str, ...], values: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """A changed row's ``names`` and its primary key, as ``CoreTx.write_many`` updates it."""
    (key,) = pk
    return {key: values[key], **{n: values[n] for n in names}}
