"""What the inference gateway's backends can serve, for the dispatcher's checks of a job
(at submission, ``api/validation.py``; before it starts, ``scheduler.py``).

The gateway writes its backends into ``inference_backends`` when it starts. What they can
serve is checked at submission against those rows, or without rows (no gateway has
started on this database yet) against the dispatcher's own settings, as the embedded
mode's; an empty list means this dispatcher cannot tell, and checks nothing. Whether one
is free for a job to start is only judged on a gateway's rows: without a gateway there is
nobody whose backends could be taken.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import InferenceBackend
from temper.policy.placement import BackendInfo, backend_info, deployment_backends
from temper.settings import Mode, Settings


async def deployment(session: AsyncSession, settings: Settings) -> list[BackendInfo]:
    """The gateway's backends, else the ones the dispatcher's settings name."""
    rows = await gateway_backends(session)
    if rows:
        return rows
    specs = deployment_backends(settings.inference, embedded=settings.mode is Mode.embedded)
    return [backend_info(spec, settings.inference) for spec in specs]


async def gateway_backends(session: AsyncSession) -> list[BackendInfo]:
    """The backends a gateway wrote, empty when none did."""
    rows = list((await session.execute(select(InferenceBackend).order_by(InferenceBackend.name))).scalars())
    return [
        BackendInfo(
            name=r.name,
            pool=r.pool,
            kind=r.kind,
            models=frozenset(r.models),
            loads_models=r.loads_models,
            weights=frozenset(r.weights),
        )
        for r in rows
    ]
