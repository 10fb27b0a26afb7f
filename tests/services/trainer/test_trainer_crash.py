"""SIGKILL the trainer process mid-job on the real stack (Kafka, Postgres, S3), restart
it, and check through the ledger that every trajectory was trained on exactly once or
skipped with a reason."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from services.trainer.ledger import SKIP_ZERO_VARIANCE
from temper.bus import KafkaBus
from temper.db import Database, Job, OutboxRow, PolicyVersion, TrainedTrajectory
from temper.events import PolicyUpdate, Topics
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

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TrainerProcess:
    """``python -m services.trainer`` pinned to one job, on the real servers."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def spawn(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.trainer"],
                cwd=ROOT,
                env={**self.env, "TEMPER_PORT": str(port)},
                stdout=log,
                stderr=log,
            )

    async def start(self) -> None:
        self.spawn()
        assert self.proc is not None
        async with httpx.AsyncClient() as client:
            for _ in range(600):
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"trainer exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
                    )
                try:
                    if (await client.get(f"{self.url}/health", timeout=1)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("trainer did not become healthy")

    async def status(self, job_id: str) -> dict:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{self.url}/v1/status", timeout=5)).json()["jobs"].get(job_id) or {}

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_sigkill_mid_job_trains_no_trajectory_twice(
    database: Database, database_url: str, kafka_bootstrap: str, s3_settings, unique: str, tmp_path: Path
):
    job_id = f"crash-{unique}"
    # group_size 4, one group per step, a checkpoint every second step
    await add_job(database, job_id, job_spec(group_size=4, groups_per_step=1, checkpoint_every=2))
    store = S3Store(s3_settings)
    await store.ensure_bucket()
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=6)
    await bus.start()
    await bus.create_topics(Topics.ALL)
    env = trainer_env(database_url, kafka_bootstrap, s3_settings, unique, job_id)
    trainer = TrainerProcess(env, tmp_path / "trainer.log")

    f = TrajectoryFactory(job_id)
    g1, g2, g3 = f.group("g1", [1, 0, 0, 0]), f.group("g2", [0, 1, 0, 1]), f.group("g3", [1, 0.5, 0, 0])
    flat = f.group("flat", [1, 1, 1, 1])
    half = f.group("half", [0, 1, 1, 0])
    g4, g5 = f.group("g4", [0, 0, 0, 1]), f.group("g5", [0.1, 0.9, 0.3, 0.7])
    everything = g1 + g2 + g3 + flat + half + g4 + g5
    await store_all(store, everything)

    async def ledger() -> dict[str, TrainedTrajectory]:
        async with database.session() as s:
            rows = (
                await s.execute(select(TrainedTrajectory).where(TrainedTrajectory.job_id == job_id))
            ).scalars()
            return {r.episode_id: r for r in rows}

    async def versions() -> list[tuple[int, int]]:
        async with database.session() as s:
            rows = (
                await s.execute(
                    select(PolicyVersion)
                    .where(PolicyVersion.job_id == job_id)
                    .order_by(PolicyVersion.version)
                )
            ).scalars()
            return [(r.version, r.step) for r in rows]

    async def until_step(number: int) -> None:
        async def reached() -> bool:
            return (await trainer.status(job_id)).get("step") == number

        await wait_for(reached, within=120, what=f"step {number}")

    try:
        await trainer.start()
        # One group at a time: keyed by episode, a group's messages spread over partitions,
        # so groups sent together may complete in either order.
        for number, group in enumerate((g1, g2), start=1):
            await send_all(bus, group)
            await until_step(number)
        await send_all(bus, flat + g3 + half[:2])

        async def mid_job() -> bool:
            st = await trainer.status(job_id)
            return st.get("step") == 3 and st.get("buffered_trajectories") == 2

        await wait_for(mid_job, within=120, what="three steps and half a group")
        # The moment of the kill: step 3 trained but not checkpointed, half a group buffered.
        rows = await ledger()
        assert {rows[m.message.episode_id].step for m in g3 + half[:2]} == {None}
        assert await versions() == [(1, 2)]
        trainer.kill()

        await trainer.start()
        # Again one group at a time, so the step each group lands on is known.
        sends = [
            (g1 + g3 + flat + half[:2], 3),  # redeliveries: g3 is retrained, g1 and flat are not
            (half[2:], 4),
            (g4, 5),
            (g5, 6),
        ]
        for messages, number in sends:
            await send_all(bus, messages)
            await until_step(number)

        async def finished() -> bool:
            return len(await versions()) == 3

        await wait_for(finished, within=120, what="policy version 3")

        rows = await ledger()
        sent = {m.message.episode_id for m in everything}
        assert set(rows) == sent, "every trajectory is in the ledger, once (episode id is its key)"
        assert all((r.step is None) != (r.skipped is None) for r in rows.values()), (
            "trained or skipped, not both"
        )
        assert {rows[m.message.episode_id].skipped for m in flat} == {SKIP_ZERO_VARIANCE}
        trained = Counter(r.step for r in rows.values() if r.step is not None)
        assert trained == {1: 4, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4}, "each step trained on exactly one group"
        assert {rows[m.message.episode_id].step for m in g3} == {3}
        assert {rows[m.message.episode_id].step for m in half} == {4}
        assert await versions() == [(1, 2), (2, 4), (3, 6)]
        async with database.session() as s:
            assert (await s.get(Job, job_id)).policy_version == 3
            outbox = list(
                (await s.execute(select(OutboxRow).where(OutboxRow.topic == Topics.POLICY_UPDATES))).scalars()
            )
        mine = [PolicyUpdate.model_validate_json(r.payload) for r in outbox]
        mine = [u for u in mine if u.job_id == job_id]
        assert sorted(u.version for u in mine) == [1, 2, 3]
        await wait_for(lambda: _all_published(database), within=30, what="the outbox relay")
        assert await store.exists(f"tenants/acme/jobs/{job_id}/versions/v3/manifest.json")
        assert await store.exists(f"tenants/acme/jobs/{job_id}/versions/v3/trainer/optimizer.safetensors")

        # The updates reached Kafka for the gateway.
        seen: set[int] = set()

        async def collect(record) -> None:
            update = PolicyUpdate.model_validate_json(record.value)
            if update.job_id == job_id:
                seen.add(update.version)

        consumer = await bus.subscribe([Topics.POLICY_UPDATES], f"test-gateway-{unique}", collect)

        async def all_seen() -> bool:
            return seen == {1, 2, 3}

        await wait_for(all_seen, within=60, what="policy.updates on Kafka")
        await consumer.stop()
    finally:
        trainer.terminate()
        await bus.stop()


async def _all_published(database: Database) -> bool:
    async with database.session() as s:
        rows = (await s.execute(select(OutboxRow).where(OutboxRow.published_at.is_(None)))).scalars()
        return not list(rows)
