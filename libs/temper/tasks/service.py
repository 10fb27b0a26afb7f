"""Task sets in the database and the object store.

Keyword-only functions that take their session (and store) explicitly. A task set is a
``task_sets`` row plus one ``tasks`` row per task (prompt, spec, hashes, validation
status); how often each task was solved is counted from ``task_outcomes``; the uploaded file is kept as JSONL in the object store under
``tenants/<tenant>/tasksets/<id>/tasks.jsonl``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, case, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from temper.clock import utcnow
from temper.db import rows
from temper.db.models import Task, TaskOutcome, TaskSet
from temper.storage import ObjectStore
from temper.storage.base import check_key
from temper.tasks.models import TaskSpec, TaskStatus, dump_jsonl
from temper.tasks.splits import HeldOut, TaskSplit, held_out_ids, record_of

MIN_ATTEMPTS_FOR_DIFFICULTY = 1


class TaskSetNotFound(LookupError):
    pass


class TaskSetAmbiguous(LookupError):
    """A name that several of the tenant's task sets carry: give the id."""

    def __init__(self, name: str, ids: list[str]) -> None:
        super().__init__(
            f"task set name {name!r} names {len(ids)} task sets of yours ({', '.join(ids)}); give the id"
        )
        self.ids = ids


def task_row_id(taskset_id: str, key: str) -> str:
    return f"{taskset_id}:{key}"


def taskset_storage_key(tenant: str, taskset_id: str) -> str:
    return check_key(f"tenants/{tenant}/tasksets/{taskset_id}/tasks.jsonl")


async def create_taskset(
    session: AsyncSession,
    store: ObjectStore | None,
    tenant: str,
    name: str,
    tasks: list[TaskSpec],
    *,
    source: str = "",
    taskset_id: str | None = None,
    held_out: HeldOut | None = None,
) -> TaskSet:
    """Store a parsed task set: its file in the object store, its rows in the session's
    transaction (status ``pending`` until validated). ``held_out`` splits it
    (:mod:`temper.tasks.splits`; :class:`~temper.tasks.splits.SplitError` before anything is
    stored when the rule holds out none or all)."""
    held = held_out_ids(tasks, held_out) if held_out is not None else set()
    ts_id = taskset_id or f"ts-{uuid.uuid4().hex[:12]}"
    key = taskset_storage_key(tenant, ts_id)
    if store is not None:
        await store.put(key, dump_jsonl(tasks).encode(), "application/x-ndjson")
    row = TaskSet(
        id=ts_id, tenant_id=tenant, name=name, source=source, status="pending", task_count=len(tasks),
        storage_key=key if store is not None else None,
        held_out=record_of(held_out, len(tasks), len(held)) if held_out is not None else None,
    )  # fmt: skip
    session.add(row)
    await session.flush()
    for task in tasks:
        meta = task.metadata.model_dump(mode="json", exclude_none=True)
        session.add(
            Task(
                id=task_row_id(ts_id, task.id),
                task_set_id=ts_id,
                key=task.id,
                kind=str(task.kind),
                prompt=task.prompt,
                spec=task.spec_dict(),
                meta=meta,
                status=str(TaskStatus.pending),
                status_reasons=[],
                prompt_hash=task.prompt_hash,
                tests_hash=task.tests_hash,
                split=str(TaskSplit.held_out if task.id in held else TaskSplit.train),
            )  # fmt: skip
        )
    await session.flush()
    return row


async def list_tasksets(session: AsyncSession, tenant: str) -> list[TaskSet]:
    rows = await session.scalars(
        select(TaskSet).where(TaskSet.tenant_id == tenant).order_by(TaskSet.created_at)
    )
    return list(rows)


async def get_taskset(session: AsyncSession, taskset_id: str, *, tenant: str | None = None) -> TaskSet:
    """The task set with this id, or (within a tenant) the one task set of the tenant with
    this name; :class:`TaskSetNotFound`, or :class:`TaskSetAmbiguous` when several have it."""
    row = await session.get(TaskSet, taskset_id)
    if row is not None and (tenant is None or row.tenant_id == tenant):
        return row
    if tenant is None:
        raise TaskSetNotFound(taskset_id)
    named = list(
        (
            await session.scalars(
                select(TaskSet)
                .where(TaskSet.tenant_id == tenant, TaskSet.name == taskset_id)
                .order_by(TaskSet.id)
            )
        ).all()
    )
    if len(named) > 1:
        raise TaskSetAmbiguous(taskset_id, [r.id for r in named])
    if not named:
        raise TaskSetNotFound(taskset_id)
    return named[0]


async def task_rows(session: AsyncSession, taskset_id: str) -> list[Task]:
    rows = await session.scalars(select(Task).where(Task.task_set_id == taskset_id).order_by(Task.key))
    return list(rows)


def spec_of(row: Task) -> TaskSpec:
    return TaskSpec.from_row(row.key, row.kind, row.prompt, row.spec, row.meta)


async def load_task(session: AsyncSession, task_id: str) -> TaskSpec:
    """A task by its row id (``<taskset>:<key>``, what episodes carry)."""
    row = await session.get(Task, task_id)
    if row is None:
        raise LookupError(f"task {task_id} not found")
    return spec_of(row)


async def status_counts(session: AsyncSession, taskset_id: str) -> dict[str, int]:
    rows = await session.execute(
        select(Task.status, func.count()).where(Task.task_set_id == taskset_id).group_by(Task.status)
    )
    return {status: n for status, n in rows.all()}


SPLIT_ALL = "all"  # an evaluation of every task of a set, whatever its part


def sampleable(taskset_id: str, split: str = TaskSplit.train) -> ColumnElement[bool]:
    """Which tasks of a set an episode may be given: every task not marked invalid
    (pending ones too, so a set can be used before its validation finishes) of the part
    ``split``: ``train`` (the default: every training path, so a held-out task never reaches
    a training episode), ``held_out``, or ``all`` (an evaluation of the whole set). The one
    definition: :func:`sampleable_tasks`, the dispatcher's scheduler and the sft trainer use it."""
    valid = and_(Task.task_set_id == taskset_id, Task.status != str(TaskStatus.invalid))
    return valid if split == SPLIT_ALL else and_(valid, Task.split == str(split))


async def sampleable_tasks(
    session: AsyncSession, taskset_id: str, split: str = TaskSplit.train
) -> list[Task]:
    """The tasks of a set an episode may be given (:func:`sampleable`), by key."""
    rows = await session.scalars(select(Task).where(sampleable(taskset_id, split)).order_by(Task.key))
    return list(rows)


async def set_task_status(
    session: AsyncSession,
    task_id: str,
    status: TaskStatus,
    reasons: list[str],
    *,
    validation: dict[str, Any] | None = None,
) -> None:
    """A task's validation verdict, with its oracle runs (``temper.tasks.oracle``) if any."""
    await session.execute(
        update(Task)
        .where(Task.id == task_id)
        .values(status=str(status), status_reasons=reasons, validation=validation)
    )


async def set_taskset_status(session: AsyncSession, taskset_id: str, status: str) -> None:
    await session.execute(update(TaskSet).where(TaskSet.id == taskset_id).values(status=status))


def outcome_row(
    *,
    episode_id: str,
    task_id: str,
    job_id: str,
    policy_version: int | None,
    passed: bool,
    reward: float,
) -> TaskOutcome:
    """One scored episode's verdict on its task, as a new row: the dispatcher's scoring
    transaction (the only writer outside tests) stages it with the episode's rows
    (``temper.db.rows.stage``). A second row for the same episode fails on the unique
    episode id."""
    return rows.new(
        TaskOutcome,
        episode_id=episode_id,
        task_id=task_id,
        job_id=job_id,
        policy_version=policy_version,
        passed=passed,
        reward=reward,
        created_at=utcnow(),
    )


def record_outcome(
    session: AsyncSession,
    *,
    episode_id: str,
    task_id: str,
    job_id: str,
    policy_version: int | None,
    passed: bool,
    reward: float,
) -> None:
    """:func:`outcome_row`, added to an ORM session (flushed with it)."""
    session.add(
        outcome_row(
            episode_id=episode_id,
            task_id=task_id,
            job_id=job_id,
            policy_version=policy_version,
            passed=passed,
            reward=reward,
        )
    )


def outcome_totals(
    *,
    taskset_id: str | None = None,
    job_id: str | None = None,
    policy_version: int | None = None,
    job_ids: Sequence[str] | None = None,
) -> Select[str, int, Any]:
    """``(task_id, attempts, passes)`` per task with at least one outcome, counted over all
    jobs unless ``job_id`` (and ``policy_version``) or ``job_ids`` narrow it."""
    query = select(
        TaskOutcome.task_id.label("task_id"),
        func.count().label("attempts"),
        func.sum(case((TaskOutcome.passed, 1), else_=0)).label("passes"),
    ).group_by(TaskOutcome.task_id)
    if taskset_id is not None:
        query = query.join(Task, Task.id == TaskOutcome.task_id).where(Task.task_set_id == taskset_id)
    if job_id is not None:
        query = query.where(TaskOutcome.job_id == job_id)
    if job_ids is not None:
        query = query.where(TaskOutcome.job_id.in_(list(job_ids)))
    if policy_version is not None:
        query = query.where(TaskOutcome.policy_version == policy_version)
    return query


async def task_totals(session: AsyncSession, taskset_id: str) -> dict[str, tuple[int, int]]:
    """``task_id -> (attempts, passes)`` over all jobs, for the tasks of one set."""
    rows = await session.execute(outcome_totals(taskset_id=taskset_id))
    return {task_id: (int(attempts), int(passes or 0)) for task_id, attempts, passes in rows}


async def outcome_breakdown(
    session: AsyncSession, taskset_id: str, *, job_id: str | None = None
) -> dict[str, dict[str, dict[int | None, tuple[int, int]]]]:
    """``task_id -> job_id -> policy_version -> (attempts, passes)`` for the tasks of one
    set (one job's only, with ``job_id``): the lineage of every pass rate."""
    query = (
        select(
            TaskOutcome.task_id,
            TaskOutcome.job_id,
            TaskOutcome.policy_version,
            func.count(),
            func.sum(case((TaskOutcome.passed, 1), else_=0)),
        )
        .join(Task, Task.id == TaskOutcome.task_id)
        .where(Task.task_set_id == taskset_id)
        .group_by(TaskOutcome.task_id, TaskOutcome.job_id, TaskOutcome.policy_version)
    )
    if job_id is not None:
        query = query.where(TaskOutcome.job_id == job_id)
    out: dict[str, dict[str, dict[int | None, tuple[int, int]]]] = {}
    for task_id, job, version, attempts, passes in await session.execute(query):
        out.setdefault(task_id, {}).setdefault(job, {})[version] = (int(attempts), int(passes or 0))
    return out


def _rate(attempts: int, passes: int) -> dict[str, Any]:
    return {"attempts": attempts, "passes": passes, "pass_rate": passes / attempts if attempts else None}


def lineage_view(jobs: dict[str, dict[int | None, tuple[int, int]]]) -> list[dict[str, Any]]:
    """Per job (sorted by id), its totals and one entry per policy version."""
    out = []
    for job_id in sorted(jobs):
        versions = jobs[job_id]
        attempts = sum(a for a, _ in versions.values())
        passes = sum(p for _, p in versions.values())
        ordered = sorted(versions.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        out.append(
            {
                "job_id": job_id,
                **_rate(attempts, passes),
                "versions": [{"policy_version": v, **_rate(a, p)} for v, (a, p) in ordered],
            }
        )
    return out


def difficulty(attempts: int, passes: int, estimate: float | None = None) -> float | None:
    """``1 - (passes + 1) / (attempts + 2)``: a pass rate with one imagined pass and one
    imagined failure, so a single episode does not swing it to 0 or 1. Until a task has
    ``MIN_ATTEMPTS_FOR_DIFFICULTY`` outcomes, the author's ``estimate``."""
    if attempts < MIN_ATTEMPTS_FOR_DIFFICULTY:
        return estimate
    return 1.0 - (passes + 1.0) / (attempts + 2.0)


def taskset_view(row: TaskSet, counts: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "source": row.source,
        "status": row.status,
        "task_count": row.task_count,
        "storage_key": row.storage_key,
        "held_out": row.held_out,
        "created_at": row.created_at.isoformat() if row.created_at else None,
        **({"counts": counts} if counts is not None else {}),
    }


def task_view(row: Task, totals: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """A task with its ``(attempts, passes)`` from :func:`task_totals`."""
    attempts, passes = totals
    estimate = (row.meta or {}).get("difficulty")
    return {
        "id": row.id,
        "key": row.key,
        "kind": row.kind,
        "status": row.status,
        "split": row.split,
        "reasons": row.status_reasons,
        "attempts": attempts,
        "passes": passes,
        "difficulty": difficulty(attempts, passes, estimate),
        "validation": row.validation,
    }
