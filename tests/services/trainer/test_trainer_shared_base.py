"""Two LoRA jobs on one base model train in one trainer process on the real stack
(Kafka, Postgres, S3): both publish adapter versions, and the process holds one copy of
the base model."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from temper import registry
from temper.bus import KafkaBus
from temper.db import Database, PolicyVersion
from temper.events import Topics
from temper.storage import S3Store
from tests.services.trainer.factory import (
    TrajectoryFactory,
    add_job,
    job_spec,
    send_all,
    store_all,
    trainer_env,
    wait_for,
)
from tests.services.trainer.test_trainer_crash import TrainerProcess

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.timeout(120)]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_two_lora_jobs_share_one_base_model_in_one_trainer(
    database: Database, database_url: str, kafka_bootstrap: str, s3_settings, unique: str, tmp_path: Path
):
    jobs = {f"lora-a-{unique}": 4, f"lora-b-{unique}": 2}  # job -> adapter rank
    for job_id, rank in jobs.items():
        spec = job_spec(group_size=4, groups_per_step=1, checkpoint_every=1, kl_coef=0.05)
        spec["algorithm"]["lora"] = {"rank": rank, "alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
        await add_job(database, job_id, spec)
    store = S3Store(s3_settings)
    await store.ensure_bucket()
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=6)
    await bus.start()
    await bus.create_topics(Topics.ALL)
    # one trainer for every job (no TEMPER_TRAINER__JOB_ID), in a consumer group of its own
    env = trainer_env(database_url, kafka_bootstrap, s3_settings, unique, "")
    del env["TEMPER_TRAINER__JOB_ID"]
    env["TEMPER_TRAINER__GROUP"] = f"trainer-{unique}"
    trainer = TrainerProcess(env, tmp_path / "trainer.log")
    trainer.spawn()  # it imports torch for a while: make the trajectories meanwhile

    groups = {}
    for job_id in jobs:
        f = TrajectoryFactory(job_id)
        groups[job_id] = [f.group("g1", [1, 0, 0, 1]), f.group("g2", [0, 1, 0.5, 0])]
        await store_all(store, groups[job_id][0] + groups[job_id][1])

    async def versions() -> dict[str, list[int]]:
        async with database.session() as s:
            rows = (await s.execute(select(PolicyVersion).where(PolicyVersion.job_id.in_(jobs)))).scalars()
            out: dict[str, list[int]] = {j: [] for j in jobs}
            for r in rows:
                out[r.job_id].append(r.version)
            return {j: sorted(v) for j, v in out.items()}

    async def healthy() -> bool:
        assert trainer.proc is not None and trainer.proc.poll() is None, (
            tmp_path / "trainer.log"
        ).read_text()
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{trainer.url}/health", timeout=1)).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        await wait_for(healthy, within=60, what="the trainer's /health")
        for n in (1, 2):
            for job_id in jobs:
                await send_all(bus, groups[job_id][n - 1])

            async def published(n: int = n) -> bool:
                return all(v == list(range(1, n + 1)) for v in (await versions()).values())

            await wait_for(published, within=60, what=f"version {n} of both jobs")

        async with httpx.AsyncClient() as client:
            status = (await client.get(f"{trainer.url}/v1/status", timeout=5)).json()
            exposition = (await client.get(f"{trainer.url}/metrics", timeout=5)).text
        assert status["base_models"] == 1, status
        assert status["shared_bases"] == {"temper-policy": sorted(jobs)}
        assert {status["jobs"][j]["shared_base"] for j in jobs} == {"temper-policy"}
        assert all(status["jobs"][j]["step"] == 2 for j in jobs)
        assert "temper_trainer_base_models 1.0" in exposition.splitlines()

        # each job's version 2 is its own adapter (its rank), published as today
        for job_id, rank in jobs.items():
            key = registry.manifest_key(registry.version_prefix("acme", job_id, 2))
            manifest, files = await registry.fetch_files(store, key)
            assert manifest.kind == "lora" and manifest.job_id == job_id and manifest.step == 2
            assert f'"r": {rank},' in files["adapter_config.json"].decode()
    finally:
        trainer.terminate()
        await bus.stop()
