"""Getting results out: a job's trajectories in bulk (JSON lines, streamed; or Parquet);
its policy versions are :mod:`services.dispatcher.api.checkpoints`.

A trajectory record is the stored trajectory (token ids, behaviour logprobs and the
policy version of each token per segment, turns, reward and reward components) plus the
episode's ``state`` and ``behaviour_version``. Records come in episode id order; ``limit``
and ``after`` page through them, and a page that stopped at ``limit`` names the next
``after`` in the ``X-Next-After`` header.
"""

from __future__ import annotations

import enum
import io
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select, true

from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import RuntimeDep, SessionDep
from services.dispatcher.api.jobs import AUTH, NOT_FOUND, JobDep
from temper.db import Episode, Job
from temper.runtime import Runtime
from temper.storage import NotFound
from temper.trajectory import Trajectory

router = APIRouter(tags=["export"], dependencies=[Depends(bearer_scheme)])

PAGE = 100  # episodes read per query while streaming
MAX_LIMIT = 1_000_000


class ExportFormat(enum.StrEnum):
    jsonl = "jsonl"
    parquet = "parquet"


def record(episode: Episode, trajectory: Trajectory) -> dict[str, Any]:
    """One exported trajectory: the stored one, with the episode's state and version."""
    return {
        **trajectory.model_dump(mode="json"),
        "state": episode.state,
        "behaviour_version": episode.behaviour_version,
    }


def trajectory_of(record: dict[str, Any]) -> Trajectory:
    """The stored trajectory back from an exported record (JSON lines or a Parquet row)."""
    fields = set(Trajectory.model_fields)
    return Trajectory.model_validate({k: v for k, v in record.items() if k in fields})


async def records(
    runtime: Runtime, job: Job, *, after: str | None, limit: int
) -> AsyncIterator[dict[str, Any]]:
    """The job's exported records in episode id order, read a page at a time (each page
    in its own session, so a long download holds no transaction open)."""
    assert runtime.db is not None and runtime.store is not None
    sent = 0
    while sent < limit:
        async with runtime.db.session() as session:
            query = (
                select(Episode)
                .where(Episode.job_id == job.id, Episode.tenant_id == job.tenant_id)
                .where(Episode.trajectory_key.is_not(None))
                .order_by(Episode.id)
                .limit(min(PAGE, limit - sent))
            )
            if after is not None:
                query = query.where(Episode.id > after)
            rows = list((await session.execute(query)).scalars())
        if not rows:
            return
        for episode in rows:
            assert episode.trajectory_key is not None
            try:
                data = await runtime.store.get(episode.trajectory_key)
            except NotFound:
                continue  # deleted by retention: the episode row outlives its objects
            yield record(episode, Trajectory.model_validate_json(data))
            sent += 1
        after = rows[-1].id


async def _next_after(session: SessionDep, job: Job, last: str | None) -> str | None:
    if last is None:
        return None
    more = await session.execute(
        select(Episode.id)
        .where(Episode.job_id == job.id, Episode.trajectory_key.is_not(None), Episode.id > last)
        .limit(1)
    )
    return last if more.first() is not None else None


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    """The records as one Parquet table: segments as a list of structs (token ids and
    logprobs as lists), free-form fields (reward components, turns, timings) as JSON text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    segment = pa.struct(
        [
            ("role", pa.string()),
            ("token_ids", pa.list_(pa.int64())),
            ("logprobs", pa.list_(pa.float64())),
            ("token_versions", pa.list_(pa.int64())),
            ("policy_version", pa.int64()),
            ("text", pa.string()),
        ]
    )
    schema = pa.schema(
        [
            ("schema_version", pa.int64()),
            ("job_id", pa.string()),
            ("episode_id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("iteration", pa.int64()),
            ("state", pa.string()),
            ("behaviour_version", pa.int64()),
            ("reward", pa.float64()),
            ("ended_by", pa.string()),
            ("segments", pa.list_(segment)),
            ("rewards", pa.string()),
            ("turns", pa.string()),
            ("timings", pa.string()),
        ]
    )
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for r in rows:
        for name in schema.names:
            value = r.get(name)
            columns[name].append(json.dumps(value) if name in ("rewards", "turns", "timings") else value)
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns, schema=schema), buffer)
    return buffer.getvalue()


def parquet_records(data: bytes) -> list[dict[str, Any]]:
    """Records back from :func:`parquet_bytes`."""
    import pyarrow.parquet as pq

    out = []
    for row in pq.read_table(io.BytesIO(data)).to_pylist():
        for name in ("rewards", "turns", "timings"):
            row[name] = json.loads(row[name]) if row[name] is not None else None
        out.append(row)
    return out


@router.get(
    "/v1/jobs/{job_id}/trajectories",
    summary="Export a job's trajectories (JSON lines streamed, or Parquet)",
    response_class=Response,
    responses={
        200: {
            "description": "one record per scored episode with a stored trajectory, in episode id order; "
            "X-Next-After names the next page's `after` when `limit` stopped the page",
            "content": {"application/x-ndjson": {}, "application/vnd.apache.parquet": {}},
        },
        **NOT_FOUND,
        **AUTH,
    },
)
async def export_trajectories(
    session: SessionDep,
    runtime: RuntimeDep,
    job: JobDep,
    format: Annotated[ExportFormat, Query(description="jsonl (streamed) or parquet")] = ExportFormat.jsonl,
    after: Annotated[str | None, Query(max_length=64, description="start after this episode id")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="at most this many records")] = MAX_LIMIT,
) -> Response:
    name = f"{job.id}-trajectories"
    if format is ExportFormat.parquet:
        rows = [r async for r in records(runtime, job, after=after, limit=limit)]
        headers = {"Content-Disposition": f'attachment; filename="{name}.parquet"'}
        last = rows[-1]["episode_id"] if len(rows) == limit else None
        if (nxt := await _next_after(session, job, last)) is not None:
            headers["X-Next-After"] = nxt
        return Response(parquet_bytes(rows), media_type="application/vnd.apache.parquet", headers=headers)
    headers = {"Content-Disposition": f'attachment; filename="{name}.jsonl"'}
    if limit < MAX_LIMIT:
        # the header goes before the body: find where this page ends first (ids only)
        ids = await session.execute(
            select(Episode.id)
            .where(Episode.job_id == job.id, Episode.trajectory_key.is_not(None))
            .where(Episode.id > after if after is not None else true())
            .order_by(Episode.id)
            .limit(limit)
        )
        page = [i for (i,) in ids]
        if len(page) == limit and (nxt := await _next_after(session, job, page[-1])) is not None:
            headers["X-Next-After"] = nxt

    async def lines() -> AsyncIterator[bytes]:
        async for r in records(runtime, job, after=after, limit=limit):
            yield (json.dumps(r, separators=(",", ":")) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)
