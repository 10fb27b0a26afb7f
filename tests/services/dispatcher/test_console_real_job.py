"""The console on a REAL job: ``temper run`` trains a small version of the example job
(real sandboxes, real generation, real gradient steps), then ``python -m
services.dispatcher`` serves that run's database and object store, and headless
Chromium reads the job's reward curve, an episode's transcript and its log."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from services.cli import main
from temper.db import Database
from temper.settings import DatabaseSettings
from temper.tenants import issue_key
from tests.services.dispatcher.test_console_browser import ARTIFACTS, chrome, log_in, run_dispatcher  # noqa: F401
from tests.services.embedded.test_temper_run import ROOT, small_spec

pytestmark = [pytest.mark.browser, pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(300)]

ACTION = "```python solution.py"


def teacher(n: int, *, seed: int = 0) -> list[tuple[dict, str]]:
    """Warm-start pairs from a teacher that always answers right: one reply to learn, so
    a few dozen steps teach the tiny policy the action format."""
    from services.embedded.localrun import generator

    return generator(f"{ROOT / 'examples/tasksets/make_offset_tasks.py'}:warm_start_examples")(
        n, p_correct=1.0, seed=seed
    )


@pytest.fixture
def real_run(tmp_path) -> Path:
    path = small_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    # One reply to learn, learnt quickly; sampled cool, so the model's actions are well formed.
    spec["local"]["warm_start"].update(
        generator=f"{Path(__file__).resolve()}:teacher", steps=300, batch_size=8, learning_rate=0.003
    )
    spec["policy"]["sampling"]["temperature"] = 0.3
    path.write_text(yaml.safe_dump(spec))
    code = main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--run-id", "console"])
    assert code == 0, "temper run failed"
    return tmp_path / "runs" / "console"


async def _issue_key(db_url: str) -> str:
    db = Database(DatabaseSettings(url=db_url))
    try:
        async with db.session() as s:
            return (await issue_key(s, tenant_id="local", name="console test")).key
    finally:
        await db.dispose()


def test_console_shows_a_real_jobs_reward_curve_and_transcript(real_run, chrome, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    db_url = f"sqlite+aiosqlite:///{real_run / 'temper.db'}"
    with sqlite3.connect(real_run / "temper.db") as conn:
        job_id, state = conn.execute("SELECT id, state FROM jobs").fetchone()
        iterations = conn.execute("SELECT COUNT(DISTINCT iteration) FROM episodes").fetchone()[0]
        # an episode whose model wrote a file the way the environment asks
        episode_id = conn.execute(
            "SELECT e.id FROM episodes e JOIN steps s ON s.episode_id = e.id AND s.kind = 'inference' "
            "WHERE e.trajectory_key IS NOT NULL AND json_extract(s.result, '$.text') LIKE ? ORDER BY e.reward DESC",
            (f"%{ACTION}%",),
        ).fetchone()
    assert state == "completed"
    assert episode_id is not None, f"no episode's action was well formed; see {real_run / 'report.html'}"
    episode_id = episode_id[0]
    summary = json.loads((real_run / "summary.json").read_text())
    curve_points = len(summary["reward_curve"])
    assert curve_points == 2 == iterations
    key = asyncio.run(_issue_key(db_url))

    # The job is finished: keep the episode state machine idle anyway.
    idle = {"TEMPER_DISPATCHER__SCHEDULER_INTERVAL_S": "3600", "TEMPER_DISPATCHER__REAPER_INTERVAL_S": "3600"}
    with run_dispatcher(db_url, real_run / "objects", tmp_path, "console-real-dispatcher.log", **idle) as url:
        wait = WebDriverWait(chrome, 20)
        chrome.get(f"{url}/console/jobs/{job_id}")
        log_in(chrome, url, key)
        wait.until(ec.presence_of_element_located((By.ID, "reward-curve")))
        curve = chrome.find_element(By.ID, "reward-curve")
        assert curve.get_attribute("data-points") == str(curve_points)
        assert len(chrome.find_elements(By.CSS_SELECTOR, "#reward-curve circle.point")) == curve_points
        assert chrome.find_element(By.ID, "job-state").text == "completed"
        assert chrome.find_element(By.ID, "pass-rates").text.strip()
        chrome.save_screenshot(str(ARTIFACTS / "console-real-job.png"))

        chrome.get(f"{url}/console/episodes/{episode_id}")
        wait.until(ec.presence_of_element_located((By.ID, "transcript")))
        turns = chrome.find_elements(By.CSS_SELECTOR, "#transcript li.turn")
        assert len(turns) == 1  # max_turns: 1
        assert ACTION in turns[0].text
        assert "solution.py" in turns[0].text and "constants.py" in turns[0].text  # the prompt
        assert "tests_passed" in chrome.find_element(By.ID, "reward-vector").text
        link = chrome.find_element(By.ID, "episode-log")
        chrome.save_screenshot(str(ARTIFACTS / "console-real-episode.png"))

        link.click()
        wait.until(lambda d: '"kind": "reward"' in d.find_element(By.TAG_NAME, "body").text)
        lines = [
            json.loads(line) for line in chrome.find_element(By.TAG_NAME, "body").text.splitlines() if line
        ]
        assert [x["kind"] for x in lines] in (["inference", "sandbox", "reward"], ["inference", "reward"])
        assert (
            lines[0]["episode_id"] == episode_id and ACTION in lines[0]["text"] and lines[0]["finish_reason"]
        )
        if lines[1]["kind"] == "sandbox":
            assert {"exit_code", "kill_reason", "stdout", "stderr", "stdout_truncated"} <= lines[1].keys()
        assert "tests_passed" in lines[-1]["components"]
        chrome.save_screenshot(str(ARTIFACTS / "console-real-episode-log.png"))
