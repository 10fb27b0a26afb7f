"""An sft job in the trainer component: it finds the running job, trains without any
trajectory, publishes every ``checkpoint_every`` steps and after the last, and a trainer
restarted from a version trains exactly the steps after it (on the same batches)."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import delete, select, update

from temper.db import Job, PolicyVersion
from temper.db.migrate import upgrade
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings
from temper.tasks.models import parse_tasks
from temper.tasks.service import create_taskset
from tests.services.trainer.factory import TENANT, add_job, wait_for
from tests.services.trainer.test_trainer_service import start, stop

pytestmark = pytest.mark.timeout(120)
WORDS = ["apple", "river", "stone", "cloud", "ember"]


@pytest.fixture
async def settings(tmp_path) -> Settings:
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    return Settings(
        db=DatabaseSettings(url=url),
        storage=StorageSettings(root=tmp_path / "objects"),
        log=LogSettings(level="WARNING"),
    )


def sft_spec(taskset: str) -> dict:
    return {
        "name": "sft-test",
        "policy": {"model": "temper-policy"},
        "tasks": {"taskset": taskset},
        "algorithm": {"name": "sft", "learning_rate": 3e-3, "batch_size": 2, "checkpoint_every": 2},
        "schedule": {"iterations": 4},  # 5 conversations: 3 steps an epoch, 12 steps
    }


async def versions(runtime, job_id: str) -> list[tuple[int, int, float]]:
    async with runtime.db.session() as s:
        rows = await s.scalars(
            select(PolicyVersion).where(PolicyVersion.job_id == job_id).order_by(PolicyVersion.version)
        )
        return [(r.version, r.step, r.metrics["loss"]) for r in rows]


async def test_an_sft_job_trains_publishes_and_resumes_after_a_restart(settings):
    runtime, component = await start(settings)
    try:
        lines = [
            {"messages": [{"role": "user", "content": f"word {i}?"}, {"role": "assistant", "content": w}]}
            for i, w in enumerate(WORDS)
        ]
        tasks = parse_tasks("".join(json.dumps(line) + "\n" for line in lines), filename="w.jsonl")
        await add_job(runtime.db, "job-sft", sft_spec("ts-words"))  # the tenant first
        async with runtime.db.session() as s:
            await create_taskset(s, runtime.store, TENANT, "words", tasks, taskset_id="ts-words")
        await wait_for(complete(runtime), within=60, what="the last step's version")
        first = await versions(runtime, "job-sft")
        # a crash after v2: the versions after it never made it to the database
        async with runtime.db.session() as s:
            await s.execute(delete(PolicyVersion).where(PolicyVersion.version > 2))
            await s.execute(update(Job).where(Job.id == "job-sft").values(policy_version=2))
    finally:
        await stop(runtime, component)
    # every version 2 steps after the one before, up to step 12; the loss fell
    assert [(v, step) for v, step, _ in first] == [(n, 2 * n) for n in range(1, 7)], first
    assert first[-1][2] < first[0][2] * 0.7, first
    runtime, component = await start(settings)
    try:
        await wait_for(complete(runtime), within=60, what="the last step's version again")
        again = await versions(runtime, "job-sft")
    finally:
        await stop(runtime, component)
    # the restarted trainer went on from v2 (step 4) on the same batches: the same losses
    assert [(v, step) for v, step, _ in again] == [(n, 2 * n) for n in range(1, 7)], again
    for (_, _, loss), (_, _, redone) in zip(first, again, strict=True):
        assert redone == pytest.approx(loss, rel=1e-4)


def complete(runtime):
    async def check() -> bool:
        rows = await versions(runtime, "job-sft")
        return bool(rows) and rows[-1][1] >= 12

    return check


class ShardedRanks:
    """What the sft path asks of torchrun's ranks: only whether they are several."""

    sharded = True


async def test_a_sharded_trainer_refuses_an_sft_job_with_a_reason(settings):
    from services.trainer.training import JobTrainer
    from temper.db import Database
    from temper.storage.local import LocalStore

    db = Database(settings.db)
    try:
        await add_job(db, "job-sft", sft_spec("ts-words"))
        trainer = JobTrainer(db, LocalStore(settings.storage.root), settings.trainer, ranks=ShardedRanks())
        assert await trainer.train_sft() is False
        assert "job-sft" not in trainer.jobs  # nothing loaded, nothing trained
        async with db.session() as s:
            reason = (await s.get(Job, "job-sft")).state_reason
        assert (
            reason
            == "stuck: sft, dpo and reward_model jobs are not built for a sharded trainer (torchrun); run a "
            "single-process trainer for them"
        )
    finally:
        await db.dispose()
