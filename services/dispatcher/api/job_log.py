"""``GET /v1/jobs/{ref}/log``: the last lines of the service log that carry the job's id
(the scheduler's, the trainer's, the gateway's, the episodes'), where this deployment's
services write one log file (``TEMPER_LOG__FILE``: ``temper serve`` and ``temper run``
do). A deployment whose services log to their own streams answers 501 naming where the
lines are: its log collector, filtered on ``job_id``."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status

from services.dispatcher.api import schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import RuntimeDep
from services.dispatcher.api.jobs import AUTH, NOT_FOUND, JobDep

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(bearer_scheme)])

CHUNK = 1 << 20
MAX_SCANNED = 256 << 20  # bytes read back from the end of the file at most, for one answer
MAX_LINES = 5000


def job_lines(path: Path, job_id: str, *, tail: int, after: str | None = None) -> list[bytes]:
    """The last ``tail`` lines of the JSON-lines log at ``path`` whose ``job_id`` is
    ``job_id`` (and whose ``ts`` is later than ``after``), oldest first; the file is read
    backwards, at most :data:`MAX_SCANNED` bytes."""
    needle = job_id.encode()
    found: list[bytes] = []
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        pos, carry, scanned = end, b"", 0
        while pos > 0 and len(found) < tail and scanned < MAX_SCANNED:
            size = min(CHUNK, pos)
            pos -= size
            f.seek(pos)
            data = f.read(size) + carry
            scanned += size
            lines = data.split(b"\n")
            carry = lines[0] if pos > 0 else b""  # a line cut at the chunk's start
            for line in reversed(lines[1:] if pos > 0 else lines):
                if needle not in line:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(entry, dict) or entry.get("job_id") != job_id:
                    continue
                if after is not None and str(entry.get("ts", "")) <= after:
                    return found[::-1]
                found.append(line)
                if len(found) >= tail:
                    break
    return found[::-1]


@router.get(
    "/{job_id}/log",
    summary="The job's log lines",
    description="The last `tail` lines of the services' log that carry this job's id (JSON lines, oldest first); "
    "`after`: only lines with a later `ts` (to follow the log). Served where the services write one log file "
    "(`temper serve`, `temper run`); elsewhere 501.",
    response_class=Response,
    responses={
        200: {"content": {"application/x-ndjson": {}}},
        501: {"model": schemas.Problem, "description": "this deployment's services do not log to one file"},
        **NOT_FOUND,
        **AUTH,
    },
)
async def get_job_log(
    runtime: RuntimeDep,
    job: JobDep,
    tail: Annotated[int, Query(ge=1, le=MAX_LINES)] = 100,
    after: Annotated[str | None, Query(max_length=40, description="a `ts` of an earlier line")] = None,
) -> Response:
    file: Any = runtime.settings.log.file
    if file is None or not await asyncio.to_thread(Path(file).is_file):
        raise HTTPException(
            status.HTTP_501_NOT_IMPLEMENTED,
            "this deployment's services log to their own streams (no TEMPER_LOG__FILE): read the lines with "
            f"job_id {job.id} where your log collector keeps them",
        )
    lines = await asyncio.to_thread(job_lines, Path(file), job.id, tail=tail, after=after)
    return Response(b"".join(line + b"\n" for line in lines), media_type="application/x-ndjson")
