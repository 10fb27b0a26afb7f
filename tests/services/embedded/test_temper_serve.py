"""``temper serve``: the whole platform in one process. A job is submitted over REST with
the admin key the first start printed, runs to completion on the in-process workers, and
shows in the console (headless Chromium); task-set validation runs in the process (no
Celery, no Redis); a restart prints where the key is instead of the key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.services.dispatcher.conftest import env, migrated_template  # noqa: F401 - fixtures
from tests.services.dispatcher.test_console_browser import ARTIFACTS, chrome, log_in  # noqa: F401
from tests.services.dispatcher.test_dispatcher_cli import free_port

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "tasksets" / "offset.jsonl"


@contextmanager
def temper_serve(
    data_dir: Path, log_name: str, **settings: str
) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """``temper serve`` on a free port; yields (url, what it printed, process) once it
    listens, and stops it with SIGTERM on exit."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    environ.update(PYTHONPATH=f"{ROOT / 'libs'}:{ROOT}", **settings)
    ARTIFACTS.mkdir(exist_ok=True)
    out_path = ARTIFACTS / log_name
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--data-dir", str(data_dir), "--port", str(port)],
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 90
            while "console: " not in out_path.read_text():
                assert proc.poll() is None, f"temper serve exited ({proc.returncode}): {out_path.read_text()}"
                assert time.monotonic() < deadline, "temper serve did not print its URL"
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}", out_path.read_text(), proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def printed_key(text: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith("admin key"))
    return line.rsplit(" ", 1)[1]


def wait_for(predicate, timeout_s: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


@pytest.mark.browser
@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_serve_runs_a_submitted_job_and_shows_it_in_the_console(tmp_path, chrome):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    data = tmp_path / "serve"
    # a Redis URL nobody answers on: embedded mode must not need one
    with temper_serve(data, "temper-serve.log", TEMPER_REDIS__URL="redis://127.0.0.1:1/0") as (
        url,
        text,
        proc,
    ):
        key = printed_key(text)
        assert key.startswith("tmp_") and (data / "admin-key").read_text().strip() == key
        assert f"{url}/console/" in text
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        # four tasks, validated in this process (their hidden tests against their solutions)
        lines = TASKS.read_text().splitlines()[:4]
        r = api.post(
            "/v1/tasksets",
            params={"name": "offset"},
            content="\n".join(lines) + "\n",
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert r.status_code == 201, r.text
        taskset = r.json()
        assert taskset["validation"]["queued"] is True, taskset
        view = wait_for(
            lambda: (v := api.get(f"/v1/tasksets/{taskset['id']}").json())["progress"]["current"] == 4 and v,
            120,
            "validation",
        )
        assert [t["status"] for t in view["tasks"]] == ["valid"] * 4, view["tasks"]

        spec = {
            "name": "served-offsets",
            "policy": {"model": "temper-policy", "sampling": {"temperature": 1.0, "max_tokens": 32}},
            "tasks": {"taskset": taskset["id"], "group_size": 2},
            "environment": {"kind": "code", "max_turns": 1, "limits": {"wall_s": 10, "memory_mb": 256}},
            "rewards": {"tests_passed": 1.0},
            "algorithm": {"name": "grpo", "groups_per_step": 2, "checkpoint_every": 1},
            "schedule": {"iterations": 2, "episodes_per_iteration": 4, "max_concurrent_episodes": 4},
        }
        r = api.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = wait_for(
            lambda: (
                (j := api.get(f"/v1/jobs/{job_id}").json())["state"] in ("completed", "failed", "cancelled")
                and j
            ),
            240,
            "the job to end",
            interval=1.0,
        )
        assert job["state"] == "completed", job

        chrome.get(f"{url}/console/jobs/{job_id}")
        log_in(chrome, url, key)
        wait = WebDriverWait(chrome, 15)
        wait.until(ec.presence_of_element_located((By.ID, "reward-curve")))
        assert chrome.find_element(By.ID, "job-state").text == "completed"
        assert chrome.find_element(By.ID, "reward-curve").get_attribute("data-points") == "2"
        chrome.save_screenshot(str(ARTIFACTS / "serve-job.png"))
        chrome.get(f"{url}/console/")
        wait.until(ec.presence_of_element_located((By.ID, "jobs")))
        assert "served-offsets" in chrome.find_element(By.ID, "jobs").text

        api.close()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        stop_s = time.monotonic() - started
    assert stop_s < 15, f"SIGTERM took {stop_s:.1f}s"
    assert key not in (data / "temper.log").read_text()  # the key is printed, never logged

    # a restart serves the same data and says where the key is, without printing it
    with temper_serve(data, "temper-serve-restart.log") as (url, text, _):
        assert key not in text
        assert f"cat {data / 'admin-key'}" in text
        r = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["state"] == "completed"


def test_a_standalone_service_refuses_an_unmigrated_database(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    environ.update(
        PYTHONPATH=f"{ROOT / 'libs'}:{ROOT}",
        TEMPER_DB__URL=f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}",
        TEMPER_STORAGE__ROOT=str(tmp_path / "objects"),
        TEMPER_PORT=str(free_port()),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "services.dispatcher"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dispatcher: the database is not migrated: run `python -m temper.db.migrate` "
        "(same TEMPER_DB__URL) first, or `temper serve`, which migrates"
    ]


@pytest.mark.timeout(120)
def test_serve_opens_a_run_directory_as_temper_run_left_it(env, tmp_path):  # noqa: F811
    """A run directory (temper.db + objects/, the job under tenant ``local``, as ``temper
    run`` writes it) is served as it is: the printed key sees the job and its trajectories."""
    import sqlite3

    from tests.services.dispatcher.conftest import KILLED_EPISODE

    settings, seeded = env
    run_dir = settings.data_dir
    with sqlite3.connect(run_dir / "temper.db") as conn:
        conn.execute(
            "INSERT INTO tenants (id, name, max_concurrent_episodes, created_at) VALUES ('local', 'local run', 1024, CURRENT_TIMESTAMP)"
        )
        conn.execute("UPDATE jobs SET tenant_id = 'local' WHERE id = ?", (seeded.job_id,))
        conn.execute("UPDATE episodes SET tenant_id = 'local' WHERE job_id = ?", (seeded.job_id,))
    with temper_serve(run_dir, "temper-serve-run-dir.log") as (url, text, _):
        key = printed_key(text)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as api:
            r = api.get(f"/v1/jobs/{seeded.job_id}")
            assert r.status_code == 200 and r.json()["state"] == "completed"
            assert api.get(f"/v1/episodes/{KILLED_EPISODE}/transcript").status_code == 200
            lines = api.get(f"/v1/jobs/{seeded.job_id}/trajectories").text.splitlines()
            assert len(lines) == 12
