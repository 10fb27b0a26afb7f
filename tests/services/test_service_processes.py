"""Every service is a runnable process: against the real stack it answers /health, and
with bad settings it exits at once with one line naming the setting."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from temper.bus.kafka import start_groups_at_end
from temper.events import Topics

SERVICES = ["dispatcher", "inference_gateway", "sandbox_worker", "reward_scorer", "trainer", "tracker"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    env.update(
        TEMPER_MODE="distributed",
        TEMPER_LOG__LEVEL="WARNING",
    )
    env.update(overrides)
    return env


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.s3
@pytest.mark.timeout(120)
@pytest.mark.parametrize("service", SERVICES)
def test_service_starts_on_the_real_stack_and_reports_health(
    service, kafka_bootstrap, postgres_database_url, s3_settings, tmp_path
):
    from temper.db.migrate import upgrade

    upgrade(postgres_database_url)
    port = free_port()
    env = service_env(
        TEMPER_PORT=str(port),
        TEMPER_DB__URL=postgres_database_url,
        TEMPER_BUS__BOOTSTRAP=kafka_bootstrap,
        TEMPER_STORAGE__ENDPOINT=s3_settings.endpoint,
        TEMPER_STORAGE__ACCESS_KEY=s3_settings.access_key,
        TEMPER_STORAGE__SECRET_KEY=s3_settings.secret_key.get_secret_value(),
        TEMPER_STORAGE__BUCKET=s3_settings.bucket,
    )
    ghost = ""
    if service == "inference_gateway":
        # Distributed mode has no default backend (/health would be 503 "none configured"):
        # serve from the CPU engine inside the gateway process.
        env["TEMPER_INFERENCE__BACKENDS"] = '[{"name": "local-0", "kind": "local"}]'
        env["TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR"] = str(tmp_path / "checkpoints")
        # An update already on the shared topic (another run's job) is history to a new
        # gateway: the database gives it the current versions, the topic only what follows.
        ghost = f"ghost-job-{uuid.uuid4().hex[:8]}"
        asyncio.run(publish_policy_update(kafka_bootstrap, ghost))
        # Its own requests group, placed at the topic's end: the stack's default group may
        # hold requests other tests left, and answering them is not what this test is for.
        group = f"test-service-gateway-{uuid.uuid4().hex[:8]}"
        env["TEMPER_INFERENCE__REQUESTS_GROUP"] = group
        asyncio.run(start_groups_at_end(kafka_bootstrap, {group: [Topics.INFERENCE_REQUESTS]}))
    log = (tmp_path / f"{service}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", f"services.{service}"], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        body = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"{service}.log").read_text()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                body = r.json()
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert body is not None and body["status"] == "ok", body
        assert body["components"]["bus"] == "ok"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert "temper_bus_messages_produced_total" in metrics
        if ghost:
            time.sleep(1.0)  # a replayed update would be tried by now
            text = (tmp_path / f"{service}.log").read_text()
            assert ghost not in text and "policy update failed" not in text, text[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"{service} did not stop within 30 s of SIGTERM: "
                + (tmp_path / f"{service}.log").read_text()[-3000:]
            ) from None
        finally:
            log.close()


async def publish_policy_update(bootstrap: str, job: str) -> None:
    from temper.bus import KafkaBus
    from temper.events import PolicyUpdate

    bus = KafkaBus(bootstrap=bootstrap)
    await bus.start()
    try:
        await bus.create_topics([Topics.POLICY_UPDATES])
        update = PolicyUpdate(job_id=job, version=1, checkpoint_key=f"checkpoints/{job}/v1/", step=1)
        await bus.send_message(Topics.POLICY_UPDATES, update)
    finally:
        await bus.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"TEMPER_BUS__BOOTSTRAP": "127.0.0.1:1", "TEMPER_BUS__CONNECT_TIMEOUT_S": "3"},
            "TEMPER_BUS__BOOTSTRAP='127.0.0.1:1'",
        ),
        (
            {"TEMPER_DB__URL": "postgresql+asyncpg://temper:pw@127.0.0.1:1/temper"},
            "TEMPER_DB__URL=postgresql+asyncpg://temper:***@127.0.0.1:1/temper",
        ),
        (
            {"TEMPER_DB__URL": "mysql://root@localhost/temper"},
            "TEMPER_DB__URL: TEMPER_DB__URL must start with",
        ),
        ({"TEMPER_API__SECRET": "a-secret"}, "TEMPER_API__SECRET is no longer a setting (removed:"),
        ({"TEMPER_SANDBOX__POOLSIZE": "3"}, "TEMPER_SANDBOX__POOLSIZE names no setting ('poolsize' is not"),
        ({"TEMPER_EVENT_LOOP": "trio"}, "TEMPER_EVENT_LOOP='trio': expected one of uvloop, asyncio"),
    ],
    ids=[
        "unreachable-broker",
        "unreachable-database",
        "unsupported-database-url",
        "retired",
        "unknown",
        "loop",
    ],
)
def test_bad_settings_give_one_clear_line_naming_the_setting(overrides, expected, tmp_path):
    # Embedded settings with the Kafka bus: every other component is local (the SQLite
    # database migrated), so the failure comes from the setting under test alone.
    from temper.db.migrate import upgrade

    upgrade(f"sqlite+aiosqlite:///{tmp_path}/t.db")
    env = service_env(
        TEMPER_MODE="embedded",
        TEMPER_BUS__KIND="kafka",
        TEMPER_DB__URL=f"sqlite+aiosqlite:///{tmp_path}/t.db",
        TEMPER_STORAGE__ROOT=str(tmp_path / "objects"),
        TEMPER_PORT=str(free_port()),
    )
    env.update(overrides)
    proc = subprocess.run(
        [sys.executable, "-m", "services.reward_scorer"], env=env, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "pw@" not in proc.stderr
