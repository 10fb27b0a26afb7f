"""What the API, the console and the run's report read of evaluations
(``services/dispatcher/evaluation.py`` makes and finishes them): a job's evaluations with
their state and results, and an evaluation's per-task rows."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import Evaluation, EvaluationResult, Job


async def points(s: AsyncSession, job_id: str, *, own: bool = False) -> list[dict[str, Any]]:
    """The evaluations of job ``job_id`` (``own``: also the one it is, for an evaluation job),
    by version then creation, each with its job's state and, once ended, its results."""
    which = Evaluation.source_job_id == job_id
    if own:
        which = which | (Evaluation.job_id == job_id)
    found = await s.execute(
        select(Evaluation, Job.state, Job.state_reason)
        .join(Job, Job.id == Evaluation.job_id)
        .where(which)
        .order_by(Evaluation.version, Evaluation.created_at, Evaluation.job_id)
    )
    out = []
    for row, state, reason in found:
        summary = row.summary or {}
        out.append(
            {
                "evaluation_job_id": row.job_id,
                "state": state,
                "state_reason": reason,
                "source_job_id": row.source_job_id,
                "version": row.version,
                "model": row.model,
                "label": row.label,
                "periodic": row.periodic,
                "taskset": row.taskset_id,
                "split": row.split,
                "samples": row.samples,
                "ks": list(row.pass_at),
                "passed_by": row.passed_by,
                "pass_threshold": row.pass_threshold,
                "pass_at": summary.get("pass_at") or {},
                "reward_mean": summary.get("reward_mean"),
                "components": summary.get("components") or {},
                "summary": row.summary,
                "created_at": row.created_at,
                "completed_at": row.completed_at,
            }
        )
    return out


async def task_rows(s: AsyncSession, evaluation_job_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per evaluation, its per-task results (by task id)."""
    if not evaluation_job_ids:
        return {}
    found = await s.execute(
        select(EvaluationResult)
        .where(EvaluationResult.job_id.in_(evaluation_job_ids))
        .order_by(EvaluationResult.job_id, EvaluationResult.task_id)
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for r in found.scalars():
        out.setdefault(r.job_id, []).append(
            {
                "task_id": r.task_id,
                "samples": r.samples,
                "passed": r.passed,
                "pass_at": r.pass_at,
                "reward_mean": r.reward_mean,
                "components": r.components,
            }  # fmt: skip
        )
    return out
