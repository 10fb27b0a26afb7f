"""Retention (``temper.retention.delete_expired``) on the local store and the real S3
server, with a migrated database; the daily beat entry; and the Celery task run by a
real worker on the real Redis."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from services.worker.app import create_app
from temper.celery_queue import make_celery
from temper.db import Episode, Job, PolicyVersion, Tenant
from temper.retention import delete_expired
from temper.settings import Settings
from temper.storage import LocalStore, ObjectStore, S3Store, object_key
from tests.services.worker.test_celery_validation import celery_worker

NOW = datetime(2025, 6, 1, tzinfo=UTC)
SNAPSHOTS = "sandbox-snapshots"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
async def store(request, tmp_path):
    if request.param == "local":
        yield LocalStore(tmp_path / "objects")
        return
    s3 = S3Store(request.getfixturevalue("s3_settings"))
    await s3.ensure_bucket()
    yield s3


def job_objects(tenant: str, job: str, episode: str) -> dict[str, str]:
    """Every kind of object a job leaves, by kind."""
    return {
        "trajectory": object_key(tenant, job, "trajectories", f"{episode}.json"),
        "log": object_key(tenant, job, "logs", f"{episode}.jsonl"),
        "old_weights": object_key(tenant, job, "checkpoints", "v1.safetensors"),
        "old_optimizer": object_key(tenant, job, "checkpoints", "v1.optimizer.safetensors"),
        "weights": object_key(tenant, job, "checkpoints", "v2.safetensors"),
        "optimizer": object_key(tenant, job, "checkpoints", "v2.optimizer.safetensors"),
        "reward": f"rewards/{job}/{episode}/t0-a0.json",
        "snapshot": f"{SNAPSHOTS}/{episode}/turn-000000-a0.tar.gz",
    }


async def seed(db, store: ObjectStore, unique: str) -> dict[str, dict[str, str]]:
    """Three jobs of one tenant: finished 40 days ago, finished yesterday, still running."""
    tenant = f"ret-{unique}"
    jobs = {"old": NOW - timedelta(days=40), "recent": NOW - timedelta(days=1), "running": None}
    objects = {}
    async with db.session() as s:
        s.add(Tenant(id=tenant, name=tenant))
    async with db.session() as s:
        for name, finished in jobs.items():
            job, episode = f"{name}-{unique}", f"ep-{name}-{unique}"
            objects[name] = job_objects(tenant, job, episode)
            s.add(
                Job(
                    id=job,
                    tenant_id=tenant,
                    name=name,
                    spec={},
                    state="completed" if finished else "running",
                    policy_version=2,
                    finished_at=finished,
                )
            )
            await s.flush()
            s.add(
                Episode(
                    id=episode,
                    job_id=job,
                    tenant_id=tenant,
                    task_id="t",
                    group_id="g",
                    state="trained",
                    session_id=episode,
                    snapshot_key=objects[name]["snapshot"],
                )
            )
            for version in (1, 2):
                s.add(
                    PolicyVersion(
                        job_id=job,
                        version=version,
                        step=version,
                        checkpoint_key=object_key(tenant, job, "checkpoints", f"v{version}.safetensors"),
                    )
                )
    for keys in objects.values():
        for key in keys.values():
            await store.put(key, b"x")
    return objects


async def remaining(store: ObjectStore, keys: dict[str, str]) -> set[str]:
    return {kind for kind, key in keys.items() if await store.exists(key)}


async def cleanup(store: ObjectStore, objects: dict[str, dict[str, str]]) -> None:
    for keys in objects.values():
        for key in keys.values():
            await store.delete(key)


async def test_objects_of_long_finished_jobs_are_deleted_but_the_latest_checkpoint(store, database, unique):
    objects = await seed(database, store, unique)
    try:
        assert (await delete_expired(store, database, NOW, None))["jobs"] == 0  # off by default
        assert await remaining(store, objects["old"]) == set(objects["old"])

        counts = await delete_expired(store, database, NOW, 30, snapshot_prefix=SNAPSHOTS)
        assert counts == {
            "jobs": 1,
            "trajectories": 1,
            "logs": 1,
            "checkpoints": 2,
            "snapshots": 1,
            "rewards": 1,
            "other": 0,
        }
        assert await remaining(store, objects["old"]) == {"weights", "optimizer"}
        assert await remaining(store, objects["recent"]) == set(objects["recent"])
        assert await remaining(store, objects["running"]) == set(objects["running"])
        async with database.session() as s:
            old = await s.get(Episode, f"ep-old-{unique}")
            recent = await s.get(Episode, f"ep-recent-{unique}")
            assert old.snapshot_key is None and recent.snapshot_key == objects["recent"]["snapshot"]
            assert await s.get(Job, f"old-{unique}") is not None  # rows stay

        again = await delete_expired(store, database, NOW, 30, snapshot_prefix=SNAPSHOTS)
        assert again["jobs"] == 1 and sum(v for k, v in again.items() if k != "jobs") == 0

        # Two days on, yesterday's job is 3 days old: a 2-day retention takes it too.
        later = await delete_expired(store, database, NOW + timedelta(days=2), 2, snapshot_prefix=SNAPSHOTS)
        assert later["jobs"] == 2 and later["trajectories"] == 1 and later["checkpoints"] == 2
        assert await remaining(store, objects["recent"]) == {"weights", "optimizer"}
        assert await remaining(store, objects["running"]) == set(objects["running"])
    finally:
        await cleanup(store, objects)


async def test_retention_days_must_be_positive(tmp_path, database):
    with pytest.raises(ValueError, match="positive"):
        await delete_expired(LocalStore(tmp_path), database, NOW, 0)


def test_the_beat_schedule_runs_retention_daily():
    schedule = create_app(Settings(redis={"url": "redis://127.0.0.1:1/0"})).conf.beat_schedule
    entry = next(e for e in schedule.values() if e["task"] == "temper.retention")
    assert entry["schedule"] == 24 * 3600
    # leases are the dispatcher's to reap (docs/operations.md): Celery has no lease task
    assert [e["task"] for e in schedule.values()] == ["temper.retention"]


@pytest.mark.redis
@pytest.mark.timeout(120)
async def test_a_worker_runs_the_retention_task(redis_url, database_url, database, tmp_path, unique):
    store = LocalStore(tmp_path / "objects")
    objects = await seed(database, store, unique)
    # The seeded jobs finished relative to NOW; the worker's clock is today's, so move them.
    delta = datetime.now(UTC) - NOW
    async with database.session() as s:
        for name in ("old", "recent"):
            job = await s.get(Job, f"{name}-{unique}")
            job.finished_at = job.finished_at.replace(tzinfo=UTC) + delta
    env = {
        "TEMPER_STORAGE__KIND": "local",
        "TEMPER_STORAGE__ROOT": str(store.root),
        "TEMPER_RETENTION__DAYS": "30",
    }
    with celery_worker(redis_url, database_url, tmp_path / "worker.log", **env) as queue:
        app = make_celery(redis_url)
        result = app.send_task("temper.retention", queue=queue)
        out = await asyncio.to_thread(result.get, timeout=90)
        result.forget()
        app.close()
    assert out["days"] == 30 and out["jobs"] == 1 and out["trajectories"] == 1 and out["checkpoints"] == 2
    assert await remaining(store, objects["old"]) == {"weights", "optimizer"}
    assert await remaining(store, objects["recent"]) == set(objects["recent"])
