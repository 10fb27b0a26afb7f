"""The dispatcher's queries of episodes and steps: episodes locked with the steps their
results answer, the expired leases; the scheduler's counts and the
scored episodes it marks trained or sends again.

Each is one SQLAlchemy Core statement built once (running it again compiles nothing),
and its rows come back as detached ``Episode`` and ``Step`` instances
(``temper.db.rows``), which ``temper.lifecycle`` moves and ``rows.write`` writes.
Step columns that a path only passes on are left out of its query (``request`` of the
step being answered: a retry reads it with ``rows.load``), so their JSON is not decoded
on every result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Select, String, and_, any_, bindparam, case, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import Episode, Step, TrainedTrajectory, rows
from temper.db.core import CoreTx, one_of
from temper.lifecycle import EPISODE_FINISHED, EpisodeState

E = EpisodeState
EPISODE_COLUMNS = rows.columns(Episode)
STEP_COLUMNS = rows.columns(Step)
# The step being answered: its request is only passed on (by a retry), so it is not read.
ANSWERED_COLUMNS = tuple(c for c in STEP_COLUMNS if c not in ("request", "result"))
KIND_OF_STATE = {E.awaiting_action: "inference", E.acting: "sandbox", E.scoring: "reward"}


class Locked(NamedTuple):
    """A locked episode, the step its result answers (None: none of that turn and kind),
    for a sandbox step that turn's inference step, and for an inference step the length of
    its prompt (counted by the database: the prompt's JSON is not read back)."""

    ep: Episode
    step: Step | None
    inference: Step | None = None
    prompt_tokens: int = 0


def _prompt_tokens(step: Any, postgres: bool) -> Any:
    """The length of an inference step's ``request.prompt_ids``, computed in the query."""
    if postgres:
        return func.json_array_length(step.c.request["prompt_ids"])
    return func.json_array_length(step.c.request, "$.prompt_ids")


def _locking(*, postgres: bool, kind: str | None, with_inference: bool) -> Select[Any]:
    """The episodes ``:ids`` in id order (locked on Postgres), each with its step of the
    current turn of kind ``kind`` (None: the kind its state waits on) and, with
    ``with_inference``, that turn's inference step. On Postgres ``:ids`` is one array
    parameter (``= ANY``): one prepared statement whatever the batch's size, where an
    expanded ``IN`` is a new statement for every size."""
    ep = Episode.__table__
    step = Step.__table__.alias("step")
    kind_of = bindparam("kind") if kind is not None else case(KIND_OF_STATE, value=ep.c.state)
    joined = ep.outerjoin(
        step, and_(step.c.episode_id == ep.c.id, step.c.turn == ep.c.turn, step.c.kind == kind_of)
    )
    columns = [*(ep.c[c] for c in EPISODE_COLUMNS), *(step.c[c] for c in ANSWERED_COLUMNS)]
    if kind == "inference":
        columns.append(_prompt_tokens(step, postgres))
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
    if postgres:
        wanted = ep.c.id == any_(bindparam("ids", type_=ARRAY(String)))
    else:
        wanted = ep.c.id.in_(bindparam("ids", expanding=True))
    query = select(*columns).select_from(joined).where(wanted).order_by(ep.c.id)
    return query.with_for_update(of=ep) if postgres else query


_LOCKING = {
    (postgres, kind): _locking(postgres=postgres, kind=kind, with_inference=kind == "sandbox")
    for postgres in (True, False)
    for kind in ("inference", "sandbox", "reward", None)
}


async def lock_episodes(tx: CoreTx, episode_ids: Sequence[str], kind: str | None) -> dict[str, Locked]:
    """The episodes ``episode_ids``, locked in id order (Postgres; SQLite has one writer),
    each with its step of ``kind`` (None: the kind its state waits on) of its current turn
    and, for a sandbox step, that turn's inference step: one query for all of them."""
    if not episode_ids:
        return {}
    query = _LOCKING[(tx.dialect != "sqlite", kind)]
    n_ep, n_step = len(EPISODE_COLUMNS), len(ANSWERED_COLUMNS)
    found: dict[str, Locked] = {}
    for values in await tx.rows(query, {"ids": list(episode_ids), **({"kind": kind} if kind else {})}):
        ep = rows.loaded(Episode, dict(zip(EPISODE_COLUMNS, values[:n_ep], strict=True)))
        step = rows.loaded_from(Step, ANSWERED_COLUMNS, values[n_ep : n_ep + n_step])
        rest = values[n_ep + n_step :]
        if kind == "sandbox":
            found[ep.id] = Locked(ep, step, rows.loaded_from(Step, STEP_COLUMNS, rest))
        elif kind == "inference":
            found[ep.id] = Locked(ep, step, None, int(rest[0] or 0))
        else:
            found[ep.id] = Locked(ep, step)
    return found


_EXPIRED = (
    select(Episode.__table__.c.id)
    .where(
        one_of(Episode.__table__.c.state, [s.value for s in KIND_OF_STATE]),
        Episode.__table__.c.lease_expires_at < bindparam("now"),
    )
    .order_by(Episode.__table__.c.lease_expires_at)
    .limit(bindparam("limit"))
)


_EXPIRED_SKIP_LOCKED = _EXPIRED.with_for_update(skip_locked=True)


async def expired_episodes(tx: CoreTx, now: Any, limit: int) -> list[str]:
    """Ids of episodes whose waiting step's lease ran out, oldest first, skipping those
    another replica has locked (Postgres)."""
    query = _EXPIRED if tx.dialect == "sqlite" else _EXPIRED_SKIP_LOCKED
    return [r[0] for r in await tx.rows(query, {"now": now, "limit": limit})]


# --- the scheduler's -------------------------------------------------------------------------
_ep, _ledger = Episode.__table__.c, TrainedTrajectory.__table__.c
# scored episodes of :job_id the trainer stepped on
TRAINED = (
    select(*(_ep[c] for c in EPISODE_COLUMNS))
    .join_from(Episode.__table__, TrainedTrajectory.__table__, _ledger.episode_id == _ep.id)
    .where(_ep.job_id == bindparam("job_id"), _ep.state == E.scored, _ledger.step.is_not(None))
    .limit(bindparam("limit"))
)
# scored episodes of :job_id last sent before :before that the trainer's ledger lacks
UNREAD_TRAJECTORIES = (
    select(*(_ep[c] for c in EPISODE_COLUMNS))
    .outerjoin_from(Episode.__table__, TrainedTrajectory.__table__, _ledger.episode_id == _ep.id)
    .where(
        _ep.job_id == bindparam("job_id"),
        _ep.state == E.scored,
        _ep.trajectory_key.is_not(None),
        _ledger.episode_id.is_(None),
        _ep.updated_at < bindparam("before"),
    )
    .order_by(_ep.updated_at)
    .limit(bindparam("limit"))
)


@dataclass
class EpisodeCounts:
    """A job's episodes: started and finished per iteration, how many are active, and how
    many failed (in all)."""

    started: Counter[int] = field(default_factory=Counter)
    finished: Counter[int] = field(default_factory=Counter)
    active: int = 0
    failed: int = 0


async def episode_counts(s: AsyncSession, job_id: str) -> EpisodeCounts:
    counts = EpisodeCounts()
    found = await s.execute(
        select(Episode.iteration, Episode.state, func.count())
        .where(Episode.job_id == job_id)
        .group_by(Episode.iteration, Episode.state)
    )
    for iteration, state, count in found:
        counts.started[iteration] += count
        if state in EPISODE_FINISHED:
            counts.finished[iteration] += count
        else:
            counts.active += count
        if state == EpisodeState.failed:
            counts.failed += count
    return counts


async def failure_reasons(s: AsyncSession, job_id: str, limit: int = 3) -> list[tuple[str, int]]:
    """The job's most frequent episode failure reasons, with their counts."""
    n = func.count().label("n")
    query = (
        select(Episode.state_reason, n)
        .where(Episode.job_id == job_id, Episode.state == EpisodeState.failed)
        .group_by(Episode.state_reason)
        .order_by(n.desc(), Episode.state_reason)
        .limit(limit)
    )
    return [(str(reason or "no reason"), int(count)) for reason, count in await s.execute(query)]


async def tenant_active_episodes(s: AsyncSession, tenant_id: str, active: Sequence[str]) -> int:
    """The tenant's episodes in the ``active`` states."""
    query = (
        select(func.count())
        .select_from(Episode)
        .where(Episode.tenant_id == tenant_id, Episode.state.in_([str(x) for x in active]))
    )
    return int(await s.scalar(query) or 0)


async def tasks_of_iteration(s: AsyncSession, job_id: str, iteration: int) -> set[str]:
    """Tasks the iteration's episodes were given (a task is not repeated while others remain).
    Distinct in the query: a pass reads a row per task, not one per episode started."""
    query = select(Episode.task_id).where(Episode.job_id == job_id, Episode.iteration == iteration).distinct()
    return set((await s.execute(query)).scalars())
