"""The episode state machine's queries: episodes locked with the steps their results
answer, the expired leases, an episode's steps.

Each is one SQLAlchemy Core statement built once (running it again compiles nothing),
and its rows come back as detached ``Episode`` and ``Step`` instances
(``temper.db.rows``), which ``temper.lifecycle`` moves and ``rows.write`` writes.
Step columns that a path only passes on are left out of its query (``request`` of the
step being answered: a retry reads it with ``rows.load``), so their JSON is not decoded
on every result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, and_, bindparam, case, select
from sqlalchemy.ext.asyncio import AsyncConnection

from temper.db import Episode, Step, rows
from temper.lifecycle import EpisodeState

E = EpisodeState
EPISODE_COLUMNS = rows.columns(Episode)
STEP_COLUMNS = rows.columns(Step)
# The step being answered: its request is only passed on (by a retry), so it is not read.
ANSWERED_COLUMNS = tuple(c for c in STEP_COLUMNS if c not in ("request", "result"))
KIND_OF_STATE = {E.awaiting_action: "inference", E.acting: "sandbox", E.scoring: "reward"}

Locked = tuple[Episode, Step | None, Step | None]


def _answered_columns(kind: str | None) -> tuple[str, ...]:
    """The answered step's columns: an inference step's request counts its prompt tokens."""
    return (*ANSWERED_COLUMNS, "request") if kind == "inference" else ANSWERED_COLUMNS


def _locking(*, for_update: bool, kind: str | None, with_inference: bool) -> Select[Any]:
    """The episodes ``:ids`` in id order (locked), each with its step of the current turn
    of kind ``kind`` (None: the kind its state waits on) and, with ``with_inference``, that
    turn's inference step."""
    ep = Episode.__table__
    step = Step.__table__.alias("step")
    kind_of = bindparam("kind") if kind is not None else case(KIND_OF_STATE, value=ep.c.state)
    joined = ep.outerjoin(
        step, and_(step.c.episode_id == ep.c.id, step.c.turn == ep.c.turn, step.c.kind == kind_of)
    )
    answered = _answered_columns(kind)
    columns = [*(ep.c[c] for c in EPISODE_COLUMNS), *(step.c[c] for c in answered)]
    if with_inference:
        inference = Step.__table__.alias("inference")
        joined = joined.outerjoin(
            inference,
            and_(
                inference.c.episode_id == ep.c.id,
                inference.c.turn == ep.c.turn,
                inference.c.kind == "inference",
            ),
        )
        columns += [inference.c[c] for c in STEP_COLUMNS]
    query = select(*columns).select_from(joined).where(ep.c.id.in_(bindparam("ids", expanding=True)))
    query = query.order_by(ep.c.id)
    return query.with_for_update(of=ep) if for_update else query


_LOCKING = {
    (for_update, kind): _locking(for_update=for_update, kind=kind, with_inference=kind == "sandbox")
    for for_update in (True, False)
    for kind in ("inference", "sandbox", "reward", None)
}


async def lock_episodes(
    conn: AsyncConnection, episode_ids: Sequence[str], kind: str | None, *, for_update: bool = True
) -> dict[str, Locked]:
    """The episodes ``episode_ids``, locked in id order (``for_update`` and not SQLite),
    each with its step of ``kind`` (None: the kind its state waits on) of its current turn
    and, for a sandbox step, that turn's inference step: one query for all of them."""
    if not episode_ids:
        return {}
    lock = for_update and conn.dialect.name != "sqlite"
    query = _LOCKING[(lock, kind)]
    answered = _answered_columns(kind)
    n_ep, n_step = len(EPISODE_COLUMNS), len(answered)
    found: dict[str, Locked] = {}
    for row in await conn.execute(query, {"ids": list(episode_ids), **({"kind": kind} if kind else {})}):
        values = tuple(row)
        ep = rows.loaded(Episode, dict(zip(EPISODE_COLUMNS, values[:n_ep], strict=True)))
        step = rows.loaded_from(Step, answered, values[n_ep : n_ep + n_step])
        inference = (
            rows.loaded_from(Step, STEP_COLUMNS, values[n_ep + n_step :]) if kind == "sandbox" else None
        )
        found[ep.id] = (ep, step, inference)
    return found


_EXPIRED = (
    select(Episode.__table__.c.id)
    .where(
        Episode.__table__.c.state.in_([s.value for s in KIND_OF_STATE]),
        Episode.__table__.c.lease_expires_at < bindparam("now"),
    )
    .order_by(Episode.__table__.c.lease_expires_at)
    .limit(bindparam("limit"))
)


async def expired_episodes(conn: AsyncConnection, now: Any, limit: int) -> list[str]:
    """Ids of episodes whose waiting step's lease ran out, oldest first, skipping those
    another replica has locked (Postgres)."""
    query = _EXPIRED if conn.dialect.name == "sqlite" else _EXPIRED.with_for_update(skip_locked=True)
    return [r[0] for r in await conn.execute(query, {"now": now, "limit": limit})]


_STEPS_OF = (
    select(*(Step.__table__.c[c] for c in STEP_COLUMNS))
    .where(Step.__table__.c.episode_id == bindparam("episode_id"))
    .order_by(Step.__table__.c.turn, Step.__table__.c.id)
)


async def live_steps(conn: AsyncConnection, episode_id: str) -> list[Step]:
    """Every step of an episode still in Postgres, in turn order (a finished episode's
    steps may have moved to object storage: ``temper.episode_steps`` reads both)."""
    return [
        rows.loaded(Step, dict(zip(STEP_COLUMNS, r, strict=True)))
        for r in await conn.execute(_STEPS_OF, {"episode_id": episode_id})
    ]
