"""The web console in headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium with the driver path given, so nothing is downloaded), against a
dispatcher process started with ``python -m services.dispatcher`` on SQLite and seeded
with a finished job. Screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.services.dispatcher.conftest import KILLED_EPISODE
from tests.services.dispatcher.test_dispatcher_cli import free_port

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("TEMPER_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TEMPER_CHROMEDRIVER", "/usr/bin/chromedriver")


@contextmanager
def run_dispatcher(
    db_url: str, storage_root: Path, data_dir: Path, log_name: str, **env: str
) -> Iterator[str]:
    """``python -m services.dispatcher`` on a SQLite database and a local object store,
    healthy; yields its URL and stops it on exit. Its output goes to test-artifacts/."""
    port = free_port()
    environ = {
        **os.environ,
        "TEMPER_DB__URL": db_url,
        "TEMPER_STORAGE__ROOT": str(storage_root),
        "TEMPER_DATA_DIR": str(data_dir),
        "TEMPER_PORT": str(port),
        "TEMPER_MODE": "embedded",
        **env,
    }
    ARTIFACTS.mkdir(exist_ok=True)
    log = (ARTIFACTS / log_name).open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.dispatcher"],
        cwd=ROOT,
        env=environ,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the dispatcher exited ({proc.returncode}); see {log.name}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the dispatcher did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def log_in(driver, url: str, key: str) -> None:
    """Log in through the console's form (from wherever the driver is sent to log in)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if "/console/login" not in driver.current_url:
        driver.get(f"{url}/console/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login-submit").click()
    # click() returns before the form's response sets the session cookie: a page opened
    # right away could still go out without it (and land on the login form again).
    WebDriverWait(driver, 15).until(lambda d: "/console/login" not in d.current_url)


@pytest.fixture
def dispatcher(env, tmp_path):
    settings, seeded = env
    # The episode state machine runs in this process: keep it off the unfinished job (no tasks are seeded
    # for it), so the page of a job that is still live can be checked.
    with sqlite3.connect(settings.db.url.split(":///", 1)[1]) as conn:
        conn.execute("UPDATE jobs SET state = 'paused' WHERE id = ?", (seeded.running_job_id,))
    with run_dispatcher(settings.db.url, settings.storage.root, tmp_path, "console-dispatcher.log") as url:
        yield url, seeded


@pytest.fixture
def chrome(tmp_path):
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not shutil.which(path):
            pytest.fail(f"{path} is missing: install Debian's {package} (scripts/setup_system.sh)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1600",
        f"--user-data-dir={tmp_path / 'chrome'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def test_console_shows_the_reward_curve_and_a_transcript(dispatcher, chrome):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    url, seeded = dispatcher
    wait = WebDriverWait(chrome, 15)

    chrome.get(f"{url}/console/jobs/{seeded.job_id}")
    wait.until(ec.presence_of_element_located((By.ID, "login-form")))  # sent to log in first
    chrome.save_screenshot(str(ARTIFACTS / "console-login.png"))
    log_in(chrome, url, seeded.key)

    # back on the job page it asked for
    wait.until(ec.presence_of_element_located((By.ID, "reward-curve")))
    assert chrome.execute_script("return document.cookie") == ""  # HttpOnly: invisible to scripts
    curve = chrome.find_element(By.ID, "reward-curve")
    assert curve.get_attribute("data-points") == "3"
    points = chrome.find_elements(By.CSS_SELECTOR, "#reward-curve circle.point")
    assert len(points) == 3
    ys = [float(p.get_attribute("cy")) for p in points]
    assert ys[0] > ys[1] > ys[2]  # rising reward is drawn going up
    assert curve.size["width"] > 300 and curve.size["height"] > 100
    assert chrome.find_element(By.ID, "job-state").text == "completed"
    assert "3 / 3" in chrome.find_element(By.ID, "job-iteration").text
    rates = chrome.find_element(By.ID, "pass-rates").text
    assert "add-1" in rates and "add-2" in rates
    chrome.save_screenshot(str(ARTIFACTS / "console-job.png"))

    chrome.find_element(By.CSS_SELECTOR, f"a[href='/console/episodes/{KILLED_EPISODE}']").click()
    wait.until(ec.presence_of_element_located((By.ID, "transcript")))
    turns = chrome.find_elements(By.CSS_SELECTOR, "#transcript li.turn")
    assert len(turns) == 2
    assert "Write a function add(a, b)" in turns[0].text
    assert "def add(a, b):" in turns[0].text
    assert "killed: timeout" in turns[0].text
    assert "1 passed" in turns[1].text
    assert "tests_passed" in chrome.find_element(By.ID, "reward-vector").text
    chrome.save_screenshot(str(ARTIFACTS / "console-episode.png"))

    chrome.get(f"{url}/console/")
    wait.until(ec.presence_of_element_located((By.ID, "jobs")))
    assert "add-numbers" in chrome.find_element(By.ID, "jobs").text
    chrome.save_screenshot(str(ARTIFACTS / "console-jobs.png"))


def test_an_unfinished_job_page_refreshes_itself(dispatcher, chrome, env):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, seeded = dispatcher
    log_in(chrome, url, seeded.key)
    chrome.get(f"{url}/console/jobs/{seeded.running_job_id}")
    live = chrome.find_element(By.ID, "live")
    assert live.get_attribute("data-refresh") == "3"
    chrome.execute_script("document.getElementById('live').setAttribute('data-marker', 'old')")
    # console.js swaps in a fresh section (without the marker) after its interval
    WebDriverWait(chrome, 15).until(
        lambda d: d.find_element(By.ID, "live").get_attribute("data-marker") is None
    )
    chrome.save_screenshot(str(ARTIFACTS / "console-running-job.png"))


@pytest.fixture
def trained(env, tmp_path):
    """The seeded job with three trained versions (the trainer's numbers on each) and one
    episode whose reward carries an unweighted measure and per-test details; a second job
    of the same shape to compare with; then the dispatcher on it."""
    import json

    settings, seeded = env
    db_path = settings.db.url.split(":///", 1)[1]
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE jobs SET state = 'paused' WHERE id = ?", (seeded.running_job_id,))
        for v, (loss, kl, grad, ent) in enumerate(
            [(0.9, 0.01, 2.0, 1.8), (0.6, 0.03, 1.5, 1.5), (0.4, 0.02, 1.1, 1.2)], 1
        ):
            metrics = {"loss": loss, "kl": kl, "grad_norm": grad, "entropy": ent, "clip_fraction": 0.1,
                       "learning_rate": 1e-5, "tokens": 100 * v,
                       "logprob_canary": {"tokens": 50, "mean": 1e-6 * v, "max": 1e-5, "failed_batches": 0}}  # fmt: skip
            conn.execute(
                "INSERT INTO policy_versions (job_id, version, checkpoint_key, step, metrics, train_s, created_at)"
                " VALUES (?, ?, ?, ?, ?, 1.0, '2026-12-04 00:00:00')",
                (seeded.job_id, v, f"k{v}", v, json.dumps(metrics)),
            )
        key = conn.execute("SELECT trajectory_key FROM episodes WHERE id = ?", (KILLED_EPISODE,)).fetchone()[
            0
        ]
    path = Path(settings.storage.root) / key
    trajectory = json.loads(path.read_text())
    trajectory["rewards"]["format_ok"] = {"value": 1.0, "ok": True}
    trajectory["rewards"]["tests_passed"]["details"]["tests"] = [
        {"name": "test_small", "passed": True}, {"name": "test_negative", "passed": False},
    ]  # fmt: skip
    path.write_text(json.dumps(trajectory))
    with run_dispatcher(settings.db.url, settings.storage.root, tmp_path, "console-trained.log") as url:
        yield url, seeded


def test_the_trainer_charts_the_compare_colours_and_the_reward_table(trained, chrome):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    url, seeded = trained
    wait = WebDriverWait(chrome, 15)
    log_in(chrome, url, seeded.key)

    chrome.get(f"{url}/console/jobs/{seeded.job_id}")
    wait.until(ec.presence_of_element_located((By.ID, "training")))
    for chart in ("chart-loss", "chart-kl", "chart-grad-norm", "chart-entropy", "chart-canary-mean"):
        svg = chrome.find_element(By.ID, chart)
        assert svg.get_attribute("data-points") == "3" and svg.size["width"] > 200, chart
    loss = [
        float(p.get_attribute("cy"))
        for p in chrome.find_elements(By.CSS_SELECTOR, "#chart-loss circle.point")
    ]
    assert loss[0] < loss[1] < loss[2], "a falling loss is drawn going down"
    ticks = [
        t.text
        for t in chrome.find_elements(By.CSS_SELECTOR, "#chart-loss text.tick")
        if t.text.startswith("v")
    ]
    assert ticks[0] == "v1" and ticks[-1] == "v3"
    assert not chrome.find_elements(By.ID, "not-trained")
    chrome.find_element(By.ID, "training").screenshot(str(ARTIFACTS / "console-training-charts.png"))

    chrome.get(f"{url}/console/compare?jobs={seeded.job_id}&jobs={seeded.job_id}-b")
    assert "There is no job" in chrome.page_source  # the second job does not exist: named
    chrome.get(f"{url}/console/compare?jobs={seeded.job_id}&jobs={seeded.running_job_id}")
    wait.until(ec.presence_of_element_located((By.ID, "compare-curves")))
    fills = {
        chrome.execute_script("return getComputedStyle(arguments[0]).fill", c)
        for c in chrome.find_elements(By.CSS_SELECTOR, "#compare-curves circle.point")
    }
    assert fills == {"rgb(47, 111, 222)"}, fills  # the first job's colour, drawn as given
    legend = [t.text for t in chrome.find_elements(By.CSS_SELECTOR, "#compare-curves .legend-label")]
    assert legend == ["add-numbers"]
    chrome.save_screenshot(str(ARTIFACTS / "console-compare-legend.png"))

    chrome.get(f"{url}/console/episodes/{KILLED_EPISODE}")
    wait.until(ec.presence_of_element_located((By.ID, "reward-vector")))
    reward = chrome.find_element(By.ID, "reward-vector")
    assert "tests_passed" in reward.text and "format_ok" not in reward.text
    assert "format_ok" in chrome.find_element(By.ID, "measured").text
    rows = chrome.find_elements(By.CSS_SELECTOR, "#reward-vector table.details tbody tr")
    assert [r.text.split() for r in rows] == [["test_small", "True"], ["test_negative", "False"]]
    assert "{'name'" not in chrome.page_source, "no Python repr on the page"
    chrome.save_screenshot(str(ARTIFACTS / "console-episode-rewards.png"))
