"""Fixtures shared by every level. Real servers come from `make stack-up`, which
writes their addresses to .stack/env; a test that needs a server that does not
answer fails with a message saying so — it is never skipped."""

from __future__ import annotations

import os
import shlex
import socket
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_stack_env() -> dict[str, str]:
    env: dict[str, str] = {}
    path = ROOT / ".stack" / "env"
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("export "):
                line = line[len("export ") :]
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = shlex.split(v)[0] if v else ""
    return env


STACK_ENV = _load_stack_env()


def stack_setting(name: str, default: str) -> str:
    return os.environ.get(name) or STACK_ENV.get(name) or default


def require_port(host_port: str, what: str) -> None:
    host, _, port = host_port.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError as exc:
        pytest.fail(f"{what} is not answering at {host_port} ({exc}); start it with `make stack-up`")


@pytest.fixture
def unique() -> str:
    """A short unique suffix for topic, bucket, group and database names."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    bootstrap = stack_setting("TEMPER_BUS__BOOTSTRAP", "127.0.0.1:59092")
    require_port(bootstrap.split(",")[0], "Kafka")
    return bootstrap


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = stack_setting("TEMPER_DB__URL", "postgresql+asyncpg://temper:temper@127.0.0.1:55432/temper")
    hostport = url.split("@", 1)[1].split("/", 1)[0]
    require_port(hostport, "Postgres")
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = stack_setting("TEMPER_REDIS__URL", "redis://127.0.0.1:56379/0")
    require_port(url.split("//", 1)[1].split("/", 1)[0], "Redis")
    return url


@pytest.fixture(scope="session")
def s3_settings():
    from pydantic import SecretStr

    from temper.settings import StorageKind, StorageSettings

    endpoint = stack_setting("TEMPER_STORAGE__ENDPOINT", "127.0.0.1:59000")
    require_port(endpoint, "the S3 server")
    return StorageSettings(
        kind=StorageKind.s3,
        endpoint=endpoint,
        access_key=stack_setting("TEMPER_STORAGE__ACCESS_KEY", "temper"),
        secret_key=SecretStr(stack_setting("TEMPER_STORAGE__SECRET_KEY", "temper-secret-key")),
        bucket=stack_setting("TEMPER_STORAGE__BUCKET", "temper"),
    )


def _postgres_admin(postgres_url: str, sql: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            for attempt in range(50):
                try:
                    await conn.execute(sql)
                    return
                except asyncpg.InsufficientPrivilegeError:
                    # DROP DATABASE ... WITH (FORCE) must end every session on the database;
                    # an autovacuum worker that just started there is a superuser's, which
                    # the test role may not end. It finishes within moments on these tiny
                    # databases: try again.
                    if attempt == 49:
                        raise
                    await asyncio.sleep(0.1)
        finally:
            await conn.close()

    asyncio.run(run())


@pytest.fixture
def postgres_database_url(postgres_url, unique):
    """A throwaway, empty database in the real Postgres, dropped afterwards."""
    name = f"test_{unique}"
    _postgres_admin(postgres_url, f'CREATE DATABASE "{name}"')
    yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    _postgres_admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    """An empty database on SQLite and on a throwaway database in the real Postgres."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    return request.getfixturevalue("postgres_database_url")


@pytest.fixture
async def database(database_url):
    """A migrated database."""
    import asyncio

    from temper.db import Database
    from temper.db.migrate import upgrade
    from temper.settings import DatabaseSettings

    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    yield db
    await db.dispose()


@pytest.fixture
async def scoring_manager():
    """A scoring sandbox manager: real bwrap sandboxes with the coverage package bound in."""
    import shutil

    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager, SandboxSettings

    # under /tmp (mode 1777): pytest's tmp_path is 0700 and the sandbox uid must reach it
    root = Path("/tmp") / f"temper-score-{uuid.uuid4().hex[:8]}"
    manager = SandboxManager(scoring_sandbox_settings(SandboxSettings(pool_size=2, workspace_root=root)))
    await manager.start()
    yield manager
    await manager.close()
    shutil.rmtree(root, ignore_errors=True)


# --- proof that the integration tests ran -----------------------------------------------
# `make test` sets TEMPER_REQUIRE_INTEGRATION=1: a run in which no test against a real
# Kafka, Postgres, S3, Redis, vLLM or MLflow passed is a failure, never a quiet success.
INTEGRATION_MARKERS = ("kafka", "postgres", "s3", "redis", "vllm", "mlflow")
_integration_passed = dict.fromkeys(INTEGRATION_MARKERS, 0)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        for marker in INTEGRATION_MARKERS:
            if marker in report.keywords:
                _integration_passed[marker] += 1


def _missing_integration() -> list[str]:
    return [m for m, n in _integration_passed.items() if n == 0]


# scripts/run_tests.sh runs the tests on the shared Kafka, S3, Redis, vLLM or MLflow in a lane of their
# own, picked by these markers: a test that uses one of those servers must say so.
SERVER_FIXTURES = {
    "kafka_bootstrap": "kafka",
    "s3_settings": "s3",
    "redis_url": "redis",
    "vllm_server": "vllm",
    "mlflow_server": "mlflow",
}


def pytest_collection_modifyitems(config, items):
    unmarked = sorted(
        f"{item.nodeid} (uses {fixture}, not marked {marker})"
        for item in items
        for fixture, marker in SERVER_FIXTURES.items()
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    )
    if unmarked:
        raise pytest.UsageError("tests on a shared server without its marker:\n" + "\n".join(unmarked))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TEMPER_REQUIRE_INTEGRATION") == "1" and exitstatus == 0 and _missing_integration():
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = ", ".join(f"{m}={n}" for m, n in _integration_passed.items())
    terminalreporter.write_line(f"integration tests passed against real servers: {counts}")
    if os.environ.get("TEMPER_REQUIRE_INTEGRATION") == "1" and _missing_integration():
        terminalreporter.write_line(
            f"FAILED: no passing integration test for {', '.join(_missing_integration())}", red=True
        )


@pytest.fixture
def torch_threads_restored():
    """torch's thread count of this thread as it was, and no core share (temper.cores), after the test."""
    import torch

    from temper import cores

    before = torch.get_num_threads()
    yield
    cores.unshare()
    torch.set_num_threads(before)
