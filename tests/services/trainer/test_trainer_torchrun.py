"""The trainer service under ``torchrun --nproc-per-node 2`` (gloo, CPU) on the real
stack (Kafka, Postgres, S3): rank 0 consumes, keeps the ledger and publishes; both ranks
train the FSDP2-sharded model. Then a SIGKILL of one rank mid-job (a follower, or rank 0
itself): torchrun restarts both ranks, and the ledger shows every trajectory trained once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load
from sqlalchemy import select

from services.trainer.ledger import SKIP_ZERO_VARIANCE
from temper.bus import KafkaBus
from temper.db import Database, Job, PolicyVersion, TrainedTrajectory
from temper.events import Topics
from temper.jobspec import JobSpec
from temper.policy import create_model
from temper.registry import read_manifest
from temper.storage import S3Store
from temper.training import Learner, LearnerConfig
from tests.services.trainer.factory import (
    TrajectoryFactory,
    add_job,
    job_spec,
    send_all,
    store_all,
    trainer_env,
    wait_for,
)
from tests.services.trainer.test_trainer_crash import ROOT, TrainerProcess

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.slow,
    pytest.mark.timeout(420),
]


class TorchrunTrainer(TrainerProcess):
    """``torchrun --nproc-per-node 2 -m services.trainer`` in a session of its own."""

    def __init__(self, env: dict[str, str], log_path: Path, *, max_restarts: int = 0) -> None:
        super().__init__(env, log_path)
        self.max_restarts = max_restarts
        self.port = 0

    def spawn(self) -> None:
        from tests.services.trainer.test_trainer_crash import free_port

        self.port = self.port or free_port()  # the same port after torchrun restarts the ranks
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.5",
                   "-m", "services.trainer"]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**self.env, "TEMPER_PORT": str(self.port)},
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def rank_pid(self, rank: int) -> int | None:
        """The process id of ``rank`` (a child of the torchrun agent), if it runs."""
        assert self.proc is not None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                env = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if f"RANK={rank}".encode() in env:
                return int(entry.name)
        return None

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def torchrun_env(
    database_url: str, kafka_bootstrap: str, s3_settings, unique: str, job_id: str
) -> dict[str, str]:
    return {
        **trainer_env(database_url, kafka_bootstrap, s3_settings, unique, job_id),
        "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}",
        "OMP_NUM_THREADS": "1",
    }


async def ledger(database: Database, job_id: str) -> dict[str, TrainedTrajectory]:
    async with database.session() as s:
        rows = (
            await s.execute(select(TrainedTrajectory).where(TrainedTrajectory.job_id == job_id))
        ).scalars()
        return {r.episode_id: r for r in rows}


async def versions(database: Database, job_id: str) -> list[tuple[int, int]]:
    async with database.session() as s:
        rows = (
            await s.execute(
                select(PolicyVersion).where(PolicyVersion.job_id == job_id).order_by(PolicyVersion.version)
            )
        ).scalars()
        return [(r.version, r.step) for r in rows]


@pytest.fixture
async def stack(kafka_bootstrap: str, s3_settings):
    store = S3Store(s3_settings)
    await store.ensure_bucket()
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=6)
    await bus.start()
    await bus.create_topics(Topics.ALL)
    yield store, bus
    await bus.stop()


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_two_ranks_train_a_job(
    database: Database,
    database_url: str,
    kafka_bootstrap: str,
    s3_settings,
    unique: str,
    tmp_path: Path,
    stack,
):
    store, bus = stack
    job_id = f"fsdp-{unique}"
    await add_job(database, job_id, job_spec(group_size=4, groups_per_step=1, checkpoint_every=2))
    trainer = TorchrunTrainer(
        torchrun_env(database_url, kafka_bootstrap, s3_settings, unique, job_id), tmp_path / "trainer.log"
    )
    f = TrajectoryFactory(job_id)
    g1, flat, g2 = f.group("g1", [1, 0, 0, 0]), f.group("flat", [1, 1, 1, 1]), f.group("g2", [0, 1, 0.5, 1])
    g3, g4 = f.group("g3", [0.2, 0.8, 0, 1]), f.group("g4", [1, 0, 1, 0.5])
    await store_all(store, g1 + flat + g2 + g3 + g4)
    spec = job_spec(group_size=4, groups_per_step=1, checkpoint_every=2)
    single = TrainerProcess(
        torchrun_env(database_url, kafka_bootstrap, s3_settings, unique, job_id), tmp_path / "one.log"
    )
    try:
        await trainer.start()
        # one group at a time, so that g1 is step 1 and g2 step 2 (flat is skipped between)
        for group, step in ((g1, 1), (flat, 1), (g2, 2)):
            await send_all(bus, group)

            async def reached(step: int = step) -> bool:
                return (await trainer.status(job_id)).get("step") == step

            await wait_for(reached, within=120, what=f"step {step}")

        async def published() -> bool:
            return await versions(database, job_id) == [(1, 2)]

        await wait_for(published, within=180, what="version 1 after two steps")
        status = await trainer.status(job_id)
        assert status["step"] == 2 and status["policy_version"] == 1
        rows = await ledger(database, job_id)
        assert {rows[m.message.episode_id].step for m in g1} == {1}
        assert {rows[m.message.episode_id].step for m in g2} == {2}
        assert {rows[m.message.episode_id].skipped for m in flat} == {SKIP_ZERO_VARIANCE}
        assert Counter(r.step for r in rows.values() if r.step) == {1: 4, 2: 4}
        # the version: served weights from rank 0, and each rank's shard of the DCP state
        key = f"tenants/acme/jobs/{job_id}/versions/v1/manifest.json"
        manifest = await read_manifest(store, key)
        assert {n for n in manifest.files if n.startswith("trainer/")} == {
            "trainer/dcp/.metadata", "trainer/dcp/__0_0.distcp", "trainer/dcp/__1_0.distcp"
        }  # fmt: skip
        assert "model.safetensors" in manifest.files
        async with database.session() as s:
            assert (await s.get(Job, job_id)).policy_version == 1
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{trainer.url}/v1/status")).json()["ranks"] == 2
        # the two ranks trained what one process trains on the same batches
        served = load(await store.get(key.replace("manifest.json", "model.safetensors")))
        one = Learner(
            create_model("tiny", seed=0),
            LearnerConfig.from_spec(JobSpec.model_validate(spec).algorithm),
            device="cpu",
        )
        one.full_forward = True  # the sharded model's forward (the whole model called)
        for group in (g1, g2):
            assert one.step([[m.trajectory for m in group]]).updated
        initial = create_model("tiny", seed=0).state_dict()
        # Float sums in another order (the order the trajectories arrive in, which Kafka does
        # not fix) differ after AdamW by 6.6e-6 or 1.3e-5 here, run to run (1e-5 failed about
        # one run in four); the later comparison after four steps uses 5e-5 too.
        for name, value in served.items():
            assert torch.allclose(value, one.model.state_dict()[name], atol=5e-5, rtol=0), name
            assert not torch.equal(value, initial[name]), f"{name} was trained"

        # the job goes on in one process (no torchrun): version 1's DCP state, saved by two
        # ranks, restored on one; two more steps match the one-process reference's
        trainer.terminate()
        await single.start()  # loads the job with its first trajectory: step 3 means it resumed at 2
        for group, step in ((g3, 3), (g4, 4)):
            await send_all(bus, group)

            async def reached_one(step: int = step) -> bool:
                return (await single.status(job_id)).get("step") == step

            await wait_for(reached_one, within=120, what=f"step {step} in one process")

        async def second() -> bool:
            return await versions(database, job_id) == [(1, 2), (2, 4)]

        await wait_for(second, within=60, what="version 2 from one process")
        one.full_forward = False  # what the one-process trainer runs
        for group in (g3, g4):
            assert one.step([[m.trajectory for m in group]]).updated
        served = load(await store.get(key.replace("v1/manifest.json", "v2/model.safetensors")))
        # Float sums in another order (the order the trajectories arrive in, which Kafka does
        # not fix) differ after AdamW by 6.6e-6 or 1.3e-5 here, run to run (1e-5 failed about
        # one run in four); the later comparison after four steps uses 5e-5 too.
        for name, value in served.items():
            assert torch.allclose(value, one.model.state_dict()[name], atol=5e-5, rtol=0), name
    finally:
        trainer.terminate()
        single.terminate()


@pytest.mark.parametrize(
    ("victim", "moment"),
    [
        # make test kills a rank mid-step; the idle kills (the same recovery) are make test-long's
        pytest.param(1, "idle", id="rank1", marks=pytest.mark.long),
        pytest.param(0, "idle", id="rank0", marks=pytest.mark.long),
        pytest.param(1, "in-step", id="rank1-in-step"),
    ],
)
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_rank_killed_mid_job_trains_no_trajectory_twice(
    victim: int,
    moment: str,
    database: Database,
    database_url: str,
    kafka_bootstrap: str,
    s3_settings,
    unique: str,
    tmp_path: Path,
    stack,
):
    store, bus = stack
    job_id = f"fsdpkill-{unique}"
    await add_job(database, job_id, job_spec(group_size=4, groups_per_step=1, checkpoint_every=2))
    trainer = TorchrunTrainer(
        torchrun_env(database_url, kafka_bootstrap, s3_settings, unique, job_id),
        tmp_path / "trainer.log",
        max_restarts=1,
    )
    f = TrajectoryFactory(job_id)
    g1, g2, g3 = f.group("g1", [1, 0, 0, 0]), f.group("g2", [0, 1, 0, 1]), f.group("g3", [1, 0.5, 0, 0])
    half = f.group("half", [0, 1, 1, 0])
    everything = g1 + g2 + g3 + half
    await store_all(store, everything)

    async def until_step(number: int) -> None:
        async def reached() -> bool:
            try:
                return (await trainer.status(job_id)).get("step") == number
            except Exception:  # noqa: BLE001 - the ranks are restarting
                return False

        await wait_for(reached, within=180, what=f"step {number}")

    try:
        await trainer.start()
        first_rank0 = trainer.rank_pid(0)
        pid = trainer.rank_pid(victim)
        assert first_rank0 and pid
        if moment == "idle":
            for number, group in enumerate((g1, g2, g3), start=1):
                await send_all(bus, group)
                await until_step(number)
            await send_all(bus, half[:2])

            async def half_buffered() -> bool:
                return (await trainer.status(job_id)).get("buffered_trajectories") == 2

            await wait_for(half_buffered, within=60, what="half a group buffered")
            # the moment of the kill: step 3 trained but not published, half a group buffered
            assert await versions(database, job_id) == [(1, 2)]
            os.kill(pid, signal.SIGKILL)  # rank 1: a follower; rank 0: the service itself
        else:
            for number, group in enumerate((g1, g2), start=1):
                await send_all(bus, group)
                await until_step(number)

            async def published() -> bool:
                return await versions(database, job_id) == [(1, 2)]

            await wait_for(published, within=60, what="version 1")
            # rank 1 frozen, so that rank 0 is caught inside step 3's collectives when it dies
            os.kill(pid, signal.SIGSTOP)
            await send_all(bus, g3)

            async def taken() -> bool:
                st = await trainer.status(job_id)
                return st.get("buffered_trajectories") == 0 and st.get("step") == 2

            await wait_for(taken, within=60, what="step 3 under way")
            await asyncio.sleep(1.0)
            assert (await trainer.status(job_id)).get("step") == 2, "rank 0 waits for rank 1"
            os.kill(pid, signal.SIGKILL)

        async def restarted() -> bool:
            pid = trainer.rank_pid(0)
            if pid is None or pid == first_rank0:
                return False
            try:
                return (await trainer.status(job_id)).get("step") in (2, 3)  # resumed from version 1
            except Exception:  # noqa: BLE001 - not listening yet
                return False

        await wait_for(restarted, within=180, what="both ranks restarted by torchrun")
        assert trainer.proc is not None and trainer.proc.poll() is None
        await until_step(3)  # g3, buffered in the ledger, trained again from version 1
        sends = [(g1 + half[:2], 3), (half[2:], 4)]  # g1 and half[:2] are redeliveries
        for messages, number in sends:
            await send_all(bus, messages)
            await until_step(number)

        async def finished() -> bool:
            return len(await versions(database, job_id)) == 2

        await wait_for(finished, within=120, what="version 2")
        rows = await ledger(database, job_id)
        assert set(rows) == {m.message.episode_id for m in everything}
        assert all(r.skipped is None for r in rows.values())
        assert Counter(r.step for r in rows.values()) == {1: 4, 2: 4, 3: 4, 4: 4}, "each trajectory once"
        assert {rows[m.message.episode_id].step for m in g3} == {3}
        assert {rows[m.message.episode_id].step for m in half} == {4}
        assert await versions(database, job_id) == [(1, 2), (2, 4)]
        log = (tmp_path / "trainer.log").read_text()
        assert log.count("trainer rank started") == 2, "rank 1 ran twice: torchrun restarted it"
        if moment == "in-step":
            # rank 0 learnt of it from the failed collective, and exited without recording step 3
            assert "a rank failed; exiting for torchrun to restart every rank" in log
    finally:
        trainer.terminate()
