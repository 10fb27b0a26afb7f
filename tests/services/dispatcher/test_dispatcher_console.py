"""The web console's pages, rendered over ASGI (the browser tests drive it for real)."""

from __future__ import annotations

import httpx
import pytest

from tests.services.dispatcher.conftest import KILLED_EPISODE

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def browser(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dispatcher") as c:
        yield c


async def login(c: httpx.AsyncClient, key: str) -> httpx.Response:
    return await c.post("/console/login", data={"key": key, "next": "/console/"})


async def test_pages_need_a_login_and_a_bad_key_is_refused(browser, seeded):
    r = await browser.get(f"/console/jobs/{seeded.job_id}")
    assert (
        r.status_code == 303 and r.headers["location"] == f"/console/login?next=/console/jobs/{seeded.job_id}"
    )
    assert (await browser.get("/")).headers["location"] == "/console/"
    r = await login(browser, "tmp_wrong")
    assert (
        r.status_code == 401 and "not valid" in r.text and "temper_key" not in r.headers.get("set-cookie", "")
    )
    r = await login(browser, seeded.key)
    assert r.status_code == 303 and r.headers["location"] == "/console/"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert (await browser.get("/console/")).status_code == 200
    r = await browser.post("/console/logout")
    assert r.status_code == 303
    browser.cookies.clear()
    assert (await browser.get("/console/")).status_code == 303


async def test_jobs_job_and_episode_pages(browser, seeded):
    await login(browser, seeded.key)
    r = await browser.get("/console/")
    assert seeded.job_id in r.text and "add-numbers" in r.text and "still-going" in r.text
    r = await browser.get(f"/console/jobs/{seeded.job_id}")
    assert r.status_code == 200
    page = r.text
    assert 'id="reward-curve"' in page and 'data-points="3"' in page and 'class="mean"' in page
    assert "add-1" in page and "33.3%" in page  # pass rate
    assert "data-refresh" not in page  # a finished job does not poll
    assert page.count('class="episode-link"') == 12
    r = await browser.get(f"/console/jobs/{seeded.running_job_id}")
    assert 'data-refresh="3"' in r.text and "No scored episodes yet" in r.text
    r = await browser.get(f"/console/jobs/{seeded.running_job_id}/live")
    assert r.text.lstrip().startswith('<section id="live"')
    r = await browser.get(f"/console/episodes/{KILLED_EPISODE}")
    assert "Write a function add(a, b)" in r.text and "killed: timeout" in r.text
    assert "def add(a, b):" in r.text and "tests_passed" in r.text
    r = await browser.get("/console/static/console.js")
    assert r.status_code == 200 and "data-refresh" in r.text


async def test_console_is_scoped_to_the_tenant_and_checks_origin(browser, seeded):
    await login(browser, seeded.other_key)
    assert seeded.job_id not in (await browser.get("/console/")).text
    assert (await browser.get(f"/console/jobs/{seeded.job_id}")).status_code == 404
    assert (await browser.get(f"/console/episodes/{KILLED_EPISODE}")).status_code == 404
    await login(browser, seeded.key)
    r = await browser.post(
        f"/console/jobs/{seeded.running_job_id}/pause", headers={"origin": "http://evil.example"}
    )
    assert r.status_code == 403
    r = await browser.post(
        f"/console/jobs/{seeded.running_job_id}/pause", headers={"origin": "http://dispatcher"}
    )
    assert r.status_code == 303
    assert "Resume" in (await browser.get(f"/console/jobs/{seeded.running_job_id}")).text


async def test_html_is_escaped(browser, client, seeded):
    from tests.services.dispatcher.conftest import SPEC

    r = await client.post("/v1/jobs", json=SPEC | {"name": "<script>alert(1)</script>"})
    assert r.status_code == 201
    await login(browser, seeded.key)
    page = (await browser.get("/console/")).text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
