"""What the scheduler asks of the gateway's side before it starts a job or an iteration:
the version every backend serving a job confirmed, and whether the job's pool has a
backend it can take (``temper.policy.placement``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.backends import gateway_backends
from temper.db import Job, PolicyVersion
from temper.jobspec import JobSpec
from temper.lifecycle import JobState
from temper.policy.placement import Need, need_of, wait_reason


def served_version_query(job_id: str) -> Select[Any]:
    """The newest version of the job every backend serving it confirmed (the gateway writes
    ``served_at`` on the row), 0 before any."""
    return select(func.coalesce(func.max(PolicyVersion.version), 0)).where(
        PolicyVersion.job_id == job_id, PolicyVersion.served_at.is_not(None)
    )


async def backend_wait(s: AsyncSession, job: Job, spec: JobSpec) -> str | None:
    """Why ``job`` cannot start now: the gateway's backends of its pool are held by the
    running jobs (``temper.policy.placement.wait_reason``); None when it can (or when no
    gateway wrote its backends: nothing to take)."""
    backends = await gateway_backends(s)
    if not backends:
        return None
    rows = await s.execute(
        select(Job.id, Job.spec).where(Job.state.in_([JobState.running, JobState.paused]), Job.id != job.id)
    )
    running = [need_for(job_id, JobSpec.model_validate(raw)) for job_id, raw in rows]
    return wait_reason(need_for(job.id, spec), running, backends)


def need_for(job_id: str, spec: JobSpec) -> Need:
    p = spec.policy
    return need_of(
        job_id, model=p.model, init=p.init, pool=p.backend_pool, lora=spec.algorithm.lora is not None
    )
