"""A dpo job in the trainer component: preference pairs uploaded as a task set, steps
through them without rollouts, versions published like an RL job's; the reference is the
initial policy (a frozen copy, or under LoRA the adapter switched off), so the first step's
loss is exactly log 2 and the pairs' implicit reward margin then grows."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from sqlalchemy import select

from temper.db import PolicyVersion
from temper.db.migrate import upgrade
from temper.registry import read_manifest
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings
from temper.tasks.models import parse_tasks
from temper.tasks.service import create_taskset
from tests.services.trainer.factory import TENANT, add_job, wait_for
from tests.services.trainer.test_trainer_service import start, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
WORDS = ["apple", "river", "stone", "cloud", "ember", "maple"]


@pytest.fixture
async def settings(tmp_path) -> Settings:
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    return Settings(
        db=DatabaseSettings(url=url),
        storage=StorageSettings(root=tmp_path / "objects"),
        log=LogSettings(level="WARNING"),
    )


def pairs() -> str:
    lines = []
    for i, word in enumerate(WORDS):
        other = WORDS[(i + 1) % len(WORDS)]
        lines.append(
            {
                "messages": [{"role": "user", "content": f"Say {word}."}],
                "chosen": [{"role": "assistant", "content": word}],
                "rejected": [{"role": "assistant", "content": other}],
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_a_dpo_job_trains_on_pairs_and_publishes_versions(settings, lora):
    algorithm = {"name": "dpo", "beta": 0.5, "learning_rate": 1e-3, "batch_size": 6, "checkpoint_every": 2}
    if lora:
        algorithm["lora"] = {"rank": 8, "alpha": 16}
    spec = {
        "name": "dpo-test",
        "policy": {"model": "temper-policy"},
        "tasks": {"taskset": "ts-pairs"},
        "algorithm": algorithm,
        "schedule": {"iterations": 10},  # 6 pairs in batches of 6: a step an epoch, 10 steps
    }
    runtime, component = await start(settings)
    try:
        await add_job(runtime.db, "job-dpo", spec)
        async with runtime.db.session() as s:
            tasks = parse_tasks(pairs(), filename="pairs.jsonl")
            await create_taskset(s, runtime.store, TENANT, "pairs", tasks, taskset_id="ts-pairs")

        async def rows() -> list[PolicyVersion]:
            async with runtime.db.session() as s:
                return list(
                    await s.scalars(
                        select(PolicyVersion)
                        .where(PolicyVersion.job_id == "job-dpo")
                        .order_by(PolicyVersion.version)
                    )
                )

        async def done() -> bool:
            versions = await rows()
            return bool(versions) and versions[-1].step >= 10

        await wait_for(done, within=150, what="the dpo job's last version")
        versions = await rows()
        manifest = await read_manifest(runtime.store, versions[-1].checkpoint_key)
        history = list(component.training.jobs["job-dpo"].history)
    finally:
        await stop(runtime, component)
    assert [(v.version, v.step) for v in versions] == [(n, 2 * n) for n in range(1, 6)]
    assert manifest.kind == ("lora" if lora else "full")
    # step 1: the policy is its reference, every margin 0: loss log 2, no pair ranked right
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and history[0]["pair_accuracy"] == 0.0
    last = history[-1]
    assert last["loss"] < math.log(2) - 0.2 and last["pair_accuracy"] == 1.0, last
    # reward_mean: the mean of beta x (log-ratio chosen - log-ratio rejected), 0 at the start
    assert history[0]["reward_mean"] == 0.0 and last["reward_mean"] > 0.5, last
