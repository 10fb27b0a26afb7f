"""The dispatcher against the real Kafka and Postgres: multi-turn episodes end to end,
and the crash test — SIGKILL the dispatcher process mid-job, restart it, and every
episode is scored exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from sqlalchemy import func, select

from temper.bus.kafka import start_groups_at_end
from temper.db import Database, Episode, OutboxRow, Step
from temper.db.migrate import upgrade
from temper.events import Topics, TrajectoryReady
from temper.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "dispatcher"))
from episode_peers import (  # noqa: E402
    Peers,
    episodes_of,
    job_spec,
    job_state,
    seed,
    settings_for,
    start_harness,
    steps_of,
    submit_job,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.timeout(120)]


@pytest.fixture
def pg_url(postgres_database_url):
    return postgres_database_url


async def test_multi_turn_episodes_through_kafka_and_postgres(tmp_path, kafka_bootstrap, pg_url, unique):
    prefix = f"kjob-{unique}-"
    h = await start_harness(tmp_path, pg_url, bootstrap=kafka_bootstrap, peers={"job_prefix": prefix})
    try:
        await seed(h.db)
        job = await submit_job(h.db, job_spec(schedule__iterations=2), job_id=f"{prefix}a")
        await wait_for(lambda: _is(h.db, job, "completed"), limit_s=60, what="job completed")
        eps = await episodes_of(h.db, job)
        assert len(eps) == 8 and {e.state for e in eps} == {"scored"}
        for ep in eps:
            assert [(s.turn, s.kind) for s in await steps_of(h.db, ep.id)] == [
                (0, "inference"),
                (0, "sandbox"),
                (1, "inference"),
                (1, "sandbox"),
                (1, "reward"),
            ]
        await wait_for(lambda: _enough(h.peers.trajectories, 8), limit_s=30, what="trajectory messages")
        assert sorted({m.episode_id for m in h.peers.trajectories}) == sorted(e.id for e in eps)
    finally:
        await h.stop()


def _spawn_dispatcher(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "services.dispatcher"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_sigkill_mid_job_loses_no_episode_and_scores_none_twice(
    tmp_path, kafka_bootstrap, pg_url, unique
):
    prefix = f"crash-{unique}-"
    await asyncio.to_thread(upgrade, pg_url)
    # The test process plays the peers; the dispatcher runs as its own process.
    runtime = Runtime(settings_for(tmp_path, pg_url, bootstrap=kafka_bootstrap), service="crash-test-peers")
    await runtime.start()
    peers = Peers(runtime, job_prefix=prefix, delay_s=0.02)
    await peers.start(group_suffix=f"-{unique}", bootstrap=kafka_bootstrap)
    db = runtime.db
    assert db is not None
    await seed(db)
    spec = job_spec(
        schedule__iterations=2,
        schedule__episodes_per_iteration=8,
        schedule__max_concurrent_episodes=4,
        environment__max_turns=3,
    )
    job = await submit_job(db, spec, job_id=f"{prefix}job")
    group = f"dispatcher-crash-{unique}"
    env = {
        **os.environ,
        "TEMPER_DB__URL": pg_url,
        "TEMPER_BUS__KIND": "kafka",
        "TEMPER_BUS__BOOTSTRAP": kafka_bootstrap,
        "TEMPER_STORAGE__KIND": "local",
        "TEMPER_STORAGE__ROOT": str(tmp_path / "objects"),
        "TEMPER_PORT": str(_free_port()),
        "TEMPER_DISPATCHER__TRAINER_ATTACHED": "false",
        "TEMPER_DISPATCHER__LEASE_S": "20",
        "TEMPER_DISPATCHER__SCHEDULER_INTERVAL_S": "0.1",
        "TEMPER_DISPATCHER__RESULTS_GROUP": group,
        "TEMPER_DISPATCHER__POLICY_GROUP": f"{group}-policy",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
    }
    await start_groups_at_end(
        kafka_bootstrap,
        {
            group: [Topics.INFERENCE_RESULTS, Topics.SANDBOX_RESULTS, Topics.REWARD_RESULTS],
            f"{group}-policy": [Topics.POLICY_UPDATES],
        },
    )
    log = tmp_path / "dispatcher.log"
    proc = _spawn_dispatcher(env, log)
    try:
        # Kill it while episodes are in every state: some scored, others mid-turn.
        await wait_for(lambda: _scored_at_least(db, job, 5), limit_s=60, what=f"5 scored episodes ({log})")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed_at = dict(await _states(db, job))
        assert sum(killed_at.values()) < 16 or killed_at.get("scored", 0) < 16, (
            f"killed too late: {killed_at}"
        )
        await asyncio.sleep(1.0)  # results pile up in Kafka meanwhile
        proc = _spawn_dispatcher(env, log)
        await wait_for(
            lambda: _is(db, job, "completed"), limit_s=90, what=f"job completed after restart ({log})"
        )
        # Rows the killed process committed stay claimed by it for the relay's claim_s (30 s);
        # the restarted relay sends them after that, so it must still be running meanwhile.
        await wait_for(
            lambda: _enough({m.episode_id for m in peers.trajectories}, 16),
            limit_s=60,
            what=f"16 trajectories ({log})",
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    try:
        eps = await episodes_of(db, job)
        assert len(eps) == 16, "no episode lost, none started twice"
        assert Counter(e.state for e in eps) == {"scored": 16}
        async with db.session() as s:
            rewards = dict(
                (
                    await s.execute(
                        select(Step.episode_id, func.count())
                        .where(Step.kind == "reward", Step.state == "done")
                        .group_by(Step.episode_id)
                    )
                ).all()
            )
            outbox = dict(
                (
                    await s.execute(
                        select(OutboxRow.key, func.count())
                        .where(OutboxRow.topic == Topics.TRAJECTORIES)
                        .group_by(OutboxRow.key)
                    )
                ).all()
            )
        assert rewards == {e.id: 1 for e in eps}, "one recorded reward result per episode"
        assert outbox == {e.id: 1 for e in eps}, "one scoring transaction per episode"
        ids: dict[str, set[uuid.UUID]] = defaultdict(set)
        for m in peers.trajectories:
            assert isinstance(m, TrajectoryReady)
            ids[m.episode_id or ""].add(m.id)
        # A relay killed between publishing and marking republishes the same message (same
        # id): at-least-once delivery, but never a second scoring of one episode.
        assert {k: len(v) for k, v in ids.items()} == {e.id: 1 for e in eps}
        assert "Traceback" not in log.read_text()
    finally:
        await peers.stop()
        await runtime.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _is(db: Database, job: str, state: str) -> bool:
    return await job_state(db, job) == state


async def _states(db: Database, job: str) -> Counter[str]:
    async with db.session() as s:
        return Counter(
            dict(
                (
                    await s.execute(
                        select(Episode.state, func.count())
                        .where(Episode.job_id == job)
                        .group_by(Episode.state)
                    )
                ).all()
            )
        )


async def _scored_at_least(db: Database, job: str, n: int) -> bool:
    return (await _states(db, job)).get("scored", 0) >= n


async def _enough(items, n: int) -> bool:
    return len(items) >= n
