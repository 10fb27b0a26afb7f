"""The console's pages and the run report in headless Chromium, with screenshots in
test-artifacts/: the episode pager, an error page, the reward components table, the
compare page, and report.html's chart (styled, not a black shape)."""

from __future__ import annotations

import pytest

from services.embedded.report import write_report
from temper.db import Database, Job
from temper.storage import LocalStore
from tests.services.dispatcher.conftest import KILLED_EPISODE
from tests.services.dispatcher.test_console_browser import ARTIFACTS, chrome, dispatcher, log_in  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


def test_pager_error_page_components_and_compare(dispatcher, chrome):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, seeded = dispatcher
    log_in(chrome, url, seeded.key)

    chrome.get(f"{url}/console/jobs/{seeded.job_id}?per_page=5")
    assert chrome.find_element(By.ID, "job-iteration").text == "3 / 3"
    seen = [a.text for a in chrome.find_elements(By.CSS_SELECTOR, "a.episode-link")]
    chrome.save_screenshot(str(ARTIFACTS / "console-pager.png"))
    while chrome.find_elements(By.ID, "next-page"):
        chrome.find_element(By.ID, "next-page").click()
        seen += [a.text for a in chrome.find_elements(By.CSS_SELECTOR, "a.episode-link")]
    assert len(seen) == len(set(seen)) == 12
    assert chrome.find_elements(By.ID, "first-page")

    chrome.get(f"{url}/console/jobs/job-missing")
    assert "There is no job job-missing" in chrome.find_element(By.ID, "error-message").text
    assert chrome.find_element(By.CSS_SELECTOR, "header.top .brand").text == "Temper"  # the console's frame
    chrome.save_screenshot(str(ARTIFACTS / "console-error.png"))

    chrome.get(f"{url}/console/episodes/{KILLED_EPISODE}")
    row = chrome.find_element(By.CSS_SELECTOR, "#reward-vector tr.weighted")
    assert row.get_attribute("data-component") == "tests_passed" and "× 1.0" in row.text  # its weight
    assert "passed" in row.text and "{" not in row.text  # details as a list, not JSON
    assert "2 turns" in chrome.find_element(By.TAG_NAME, "main").text
    chrome.save_screenshot(str(ARTIFACTS / "console-episode-components.png"))

    chrome.get(f"{url}/console/")
    chrome.find_element(By.CSS_SELECTOR, f"input[name=jobs][value='{seeded.job_id}']").click()
    chrome.find_element(By.CSS_SELECTOR, f"input[name=jobs][value='{seeded.running_job_id}']").click()
    chrome.find_element(By.ID, "compare-submit").click()
    # click() returns before the form's navigation: wait for the compare page itself
    svg = WebDriverWait(chrome, 15).until(lambda c: c.find_element(By.ID, "compare-curves"))
    assert svg.get_attribute("data-series") == "1"
    line = chrome.find_element(By.CSS_SELECTOR, f"#compare-curves polyline[data-job='{seeded.job_id}']")
    swatches = {
        row.find_element(By.TAG_NAME, "a").text: row.find_element(By.CSS_SELECTOR, "i.swatch")
        for row in chrome.find_elements(By.CSS_SELECTOR, "#compare-table tbody tr")
    }
    # the table's swatch is the line's colour
    colour = "return getComputedStyle(arguments[0])[arguments[1]]"
    assert chrome.execute_script(colour, swatches[seeded.job_id], "backgroundColor") == chrome.execute_script(
        colour, line, "stroke"
    )
    assert seeded.running_job_id in chrome.find_element(By.ID, "compare-table").text
    chrome.save_screenshot(str(ARTIFACTS / "console-compare.png"))


async def test_the_report_chart_is_styled(env, chrome, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    settings, seeded = env
    db, store = Database(settings.db), LocalStore(settings.storage.root)
    try:
        async with db.session() as session:
            job = await session.get(Job, seeded.job_id)
            await write_report(session, store, job, tmp_path, seconds=1.0)
    finally:
        await db.dispose()
    chrome.get(f"file://{tmp_path / 'report.html'}")
    band = chrome.find_element(By.CSS_SELECTOR, "#reward-curve polygon.band")
    mean = chrome.find_element(By.CSS_SELECTOR, "#reward-curve polyline.mean")
    assert band.value_of_css_property("fill") == "rgba(47, 111, 222, 0.15)"
    assert mean.value_of_css_property("fill") == "none"
    assert "weighted" in chrome.find_element(By.CSS_SELECTOR, "table.rewards").get_attribute("innerHTML")
    chrome.save_screenshot(str(ARTIFACTS / "report.png"))
