"""An episode's steps, wherever they are kept.

While an episode runs, and for ``archive_after_s`` after it finished, its steps are rows
of ``steps`` in Postgres. Then :func:`archive_finished` moves them to object storage,
one JSON object per episode at ``tenants/<tenant>/jobs/<job>/steps/<episode>.json``,
records that key in ``episodes.steps_key`` and deletes the rows, so Postgres holds the
live work and the recent past, not the history (docs/capacity.md).

:func:`read_steps` is the one reader: the transcripts, the episode log and whatever
falls back to the steps read them through it, from Postgres or from the archive, as the
same detached ``temper.db.Step`` rows.

Archived steps are kept as long as their episode's row: ``temper.retention`` expires a
finished job's trajectories and logs but not its ``steps/`` objects, which are then what
a transcript is read from (as the rows were before).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, any_, bindparam, delete, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from temper import metrics
from temper.clock import utcnow
from temper.db import Database, Episode, Step, rows
from temper.db.core import CoreTx, core_of, one_of
from temper.lifecycle import EPISODE_FINISHED
from temper.logs import log_event
from temper.storage import NotFound, ObjectStore, object_key

log = logging.getLogger("temper.episode_steps")

STEP_COLUMNS = rows.columns(Step)
_DATES = ("lease_expires_at", "created_at", "completed_at")
FORMAT = 1


def steps_key(tenant: str, job_id: str, episode_id: str) -> str:
    return object_key(tenant, job_id, "steps", f"{episode_id}.json")


def encode_steps(steps: Sequence[Step]) -> bytes:
    """An episode's steps as one JSON document (every column; datetimes in ISO 8601)."""
    out = []
    for step in steps:
        row: dict[str, Any] = {c: getattr(step, c) for c in STEP_COLUMNS}
        for c in _DATES:
            row[c] = row[c].isoformat() if row[c] is not None else None
        out.append(row)
    return json.dumps({"format": FORMAT, "steps": out}, separators=(",", ":")).encode()


def decode_steps(data: bytes) -> list[Step]:
    doc = json.loads(data)
    if doc.get("format") != FORMAT:
        raise ValueError(f"archived steps in format {doc.get('format')!r}, expected {FORMAT}")
    steps = []
    for row in doc["steps"]:
        for c in _DATES:
            row[c] = datetime.fromisoformat(row[c]) if row[c] is not None else None
        steps.append(rows.loaded(Step, row))
    return steps


_STEPS_OF = (
    select(*(Step.__table__.c[c] for c in STEP_COLUMNS))
    .where(Step.__table__.c.episode_id == bindparam("episode_id"))
    .order_by(Step.__table__.c.turn, Step.__table__.c.id)
)


async def read_steps(tx: CoreTx | AsyncSession, store: ObjectStore, episode: Episode) -> list[Step]:
    """Every step of ``episode`` in turn order, from Postgres or, once archived, from
    object storage, in the caller's transaction (a ``CoreTx`` or a session). An archive
    that is gone (deleted by hand) reads as no steps."""
    if episode.steps_key:
        try:
            return decode_steps(await store.get(episode.steps_key))
        except NotFound:
            log_event(log, "archived steps missing", logging.WARNING, key=episode.steps_key)
            return []
    return [
        rows.loaded(Step, dict(zip(STEP_COLUMNS, r, strict=True)))
        for r in await (await core_of(tx)).rows(_STEPS_OF, {"episode_id": episode.id})
    ]


def _of_episodes(postgres: bool) -> Any:
    """``steps.episode_id`` among ``:ids``: one array parameter on Postgres (one prepared
    statement whatever the count), an expanded ``IN`` elsewhere."""
    column = Step.__table__.c.episode_id
    if postgres:
        return column == any_(bindparam("ids", type_=ARRAY(String)))
    return column.in_(bindparam("ids", expanding=True))


_STEPS_OF_MANY = {
    postgres: select(*(Step.__table__.c[c] for c in STEP_COLUMNS))
    .where(_of_episodes(postgres))
    .order_by(Step.__table__.c.episode_id, Step.__table__.c.turn, Step.__table__.c.id)
    for postgres in (True, False)
}


async def _steps_of_many(tx: CoreTx, ids: list[str]) -> dict[str, list[Step]]:
    out: dict[str, list[Step]] = {i: [] for i in ids}
    for r in await tx.rows(_STEPS_OF_MANY[tx.dialect != "sqlite"], {"ids": ids}):
        step = rows.loaded(Step, dict(zip(STEP_COLUMNS, r, strict=True)))
        out[step.episode_id].append(step)
    return out


async def read_steps_of(tx: CoreTx, store: ObjectStore, episodes: Sequence[Episode]) -> dict[str, list[Step]]:
    """:func:`read_steps` of several episodes: one query for those still in Postgres."""
    out: dict[str, list[Step]] = {ep.id: [] for ep in episodes}
    live = [ep.id for ep in episodes if not ep.steps_key]
    if live:
        out.update(await _steps_of_many(tx, live))
    for ep in episodes:
        if ep.steps_key:
            out[ep.id] = await read_steps(tx, store, ep)
    return out


_ep = Episode.__table__.c
_DUE = (
    select(_ep.id, _ep.tenant_id, _ep.job_id)
    .where(
        one_of(_ep.state, [s.value for s in EPISODE_FINISHED]),
        _ep.steps_key.is_(None),
        _ep.updated_at < bindparam("before"),
    )
    .order_by(_ep.updated_at)
    .limit(bindparam("limit"))
)
_MARK = (
    update(Episode)
    .where(_ep.id == bindparam("episode_id"), _ep.steps_key.is_(None))
    .values(steps_key=bindparam("key"))
)
_DELETE = {postgres: delete(Step).where(_of_episodes(postgres)) for postgres in (True, False)}


async def archive_finished(db: Database, store: ObjectStore, *, after_s: float, limit: int = 200) -> int:
    """Move the steps of up to ``limit`` episodes that finished more than ``after_s`` ago
    to object storage; returns how many episodes. The steps of a finished episode never
    change, so they are read, put (under a key fixed per episode: a repeat overwrites the
    same object) and only then marked and deleted in one transaction; a crash in between
    leaves them in Postgres for the next pass. Replicas may run it at once: the mark is
    conditional, and deleting rows another one deleted deletes nothing."""
    async with db.core() as tx:
        due = await tx.rows(_DUE, {"before": utcnow() - timedelta(seconds=after_s), "limit": limit})
        if not due:
            return 0
        by_episode = await _steps_of_many(tx, [episode_id for episode_id, _, _ in due])
    keys = {episode_id: steps_key(tenant, job_id, episode_id) for episode_id, tenant, job_id in due}
    for episode_id, steps in by_episode.items():
        await store.put(keys[episode_id], encode_steps(steps), "application/json")
    async with db.core() as tx:
        await tx.run(_MARK, [{"episode_id": e, "key": k} for e, k in keys.items()])
        await tx.run(_DELETE[tx.dialect != "sqlite"], {"ids": list(keys)})
    moved = sum(len(s) for s in by_episode.values())
    metrics.STEPS_ARCHIVED.inc(moved)
    log_event(log, "steps archived", episodes=len(keys), steps=moved)
    return len(keys)
