"""The validation pipeline through a real Celery worker on the real Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from temper.celery_queue import make_celery
from temper.db import Tenant
from temper.tasks import service
from temper.tasks.harbor import import_task_dir
from temper.tasks.importers import arithmetic_tasks, humaneval
from tests.libs.tasks.fixtures import harbor_task

pytestmark = [pytest.mark.redis, pytest.mark.sandbox, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[3]


@contextmanager
def celery_worker(redis_url: str, database_url: str, log_path: Path, **env: str) -> Iterator[str]:
    """A real ``celery worker`` process on its own queue (yielded), with ``env`` on top of
    the database and Redis settings; stopped on exit."""
    queue = f"temper-test-{uuid.uuid4().hex[:8]}"
    environ = {
        **os.environ,
        "TEMPER_REDIS__URL": redis_url,
        "TEMPER_DB__URL": database_url,
        "TEMPER_SANDBOX__WORKSPACE_ROOT": f"/tmp/temper-celery-{uuid.uuid4().hex[:8]}",
        "TEMPER_SANDBOX__POOL_SIZE": "1",
        "PYTHONWARNINGS": "ignore",
        **env,
    }
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker", "worker", "--pool=solo", "-Q", queue,
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
        cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield queue
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def worker(redis_url, database_url, database, tmp_path):
    with celery_worker(redis_url, database_url, tmp_path / "worker.log") as queue:
        yield queue


async def test_a_worker_validates_a_task_set_with_visible_progress(redis_url, database, worker, tmp_path):
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))
    tasks = [*humaneval()[:3], *arithmetic_tasks(2), import_task_dir(harbor_task(tmp_path))]
    async with database.session() as s:
        row = await service.create_taskset(s, None, "acme", "celery", tasks)
    app = make_celery(redis_url)
    result = app.send_task("temper.validate_taskset", args=[row.id], queue=worker)
    states = set()
    deadline = time.monotonic() + 100
    while not result.ready() and time.monotonic() < deadline:
        states.add(result.state)
        if result.state == "PROGRESS":
            assert result.info["total"] == 6 and 0 <= result.info["current"] <= 6
        await asyncio.sleep(0.05)
    assert result.ready(), "the Celery worker did not finish in time"
    out = result.get(timeout=5)
    assert out["counts"] == {"valid": 6}
    assert states & {"STARTED", "PROGRESS"}
    async with database.session() as s:
        rows = await service.task_rows(s, row.id)
    assert {t.status for t in rows} == {"valid"}
    # the oracle (reference, or the Harbor task's solve.sh) passed; doing nothing did not
    assert {(t.validation["oracle"]["passed"], t.validation["null"]["passed"]) for t in rows} == {
        (True, False)
    }
    result.forget()
    app.close()
