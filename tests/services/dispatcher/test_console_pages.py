"""The console as people read it: iterations and turns counted from 1, a pager on the
episode list, console-styled error pages, reward components as a table that marks the
weighted ones, and chart bands inside the reward range (rendered over ASGI)."""

from __future__ import annotations

import re

import httpx
import pytest

from services.dispatcher.api.schemas import IterationReward
from services.dispatcher.console import routes
from services.dispatcher.console.charts import reward_curve_svg
from tests.services.dispatcher.conftest import KILLED_EPISODE

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def browser(app, seeded):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dispatcher") as c:
        r = await c.post("/console/login", data={"key": seeded.key, "next": "/console/"})
        assert r.status_code == 303
        yield c


def test_iterations_and_turns_are_counted_from_one():
    assert routes.iteration_shown(7, 8) == 8  # the last of 8 iterations
    assert routes.iteration_shown(0, 8) == 1
    assert routes.iteration_shown(9, 8) == 8  # never past the total
    assert [routes.plural(n, "turn") for n in (0, 1, 2)] == ["0 turns", "1 turn", "2 turns"]


async def test_the_episode_list_has_a_pager(browser, seeded, monkeypatch):
    monkeypatch.setattr(routes, "EPISODES_PER_PAGE", 5)
    seen: list[str] = []
    url = f"/console/jobs/{seeded.job_id}"
    pages = 0
    while url:
        r = await browser.get(url)
        assert r.status_code == 200
        pages += 1
        ids = re.findall(r'class="episode-link" href="/console/episodes/([^"]+)"', r.text)
        assert 0 < len(ids) <= 5
        seen += ids
        nxt = re.search(r'id="next-page" href="([^"]+)"', r.text)
        url = (
            f"/console/jobs/{seeded.job_id}" + nxt.group(1).replace("&amp;", "&").split("#")[0] if nxt else ""
        )
        if pages > 1:
            assert 'id="first-page"' in r.text
    assert pages == 3 and len(seen) == len(set(seen)) == 12
    # the filter stays on across pages
    r = await browser.get(f"/console/jobs/{seeded.job_id}", params={"task": "add-1"})
    assert r.status_code == 200
    nxt = re.search(r'id="next-page" href="([^"]+)"', r.text)
    assert nxt and "task=add-1" in nxt.group(1)
    # a bad cursor shows the first page rather than an error
    assert (
        await browser.get(f"/console/jobs/{seeded.job_id}", params={"cursor": "garbage"})
    ).status_code == 200


async def test_error_pages_are_console_pages(browser, seeded):
    for path, text in (
        ("/console/jobs/job-nope", "There is no job job-nope"),
        ("/console/episodes/ep-nope", "There is no episode ep-nope"),
        ("/console/no/such/page", "There is no console page at /console/no/such/page"),
    ):
        r = await browser.get(path)
        assert r.status_code == 404
        assert r.headers["content-type"].startswith("text/html")
        assert 'id="error-message"' in r.text and text in r.text
        assert "/console/static/console.css" in r.text and "Log out" in r.text
    r = await browser.post(f"/console/jobs/{seeded.job_id}/cancel")  # completed: cannot cancel
    assert r.status_code == 409 and "Cannot cancel a job that is completed" in r.text
    assert (await browser.get("/console/static/console.css")).status_code == 200


async def test_the_job_and_episode_pages_count_as_people_do(browser, seeded):
    r = await browser.get(f"/console/jobs/{seeded.running_job_id}")
    assert re.search(r'id="job-iteration">2 / 3<', r.text)  # 0-based iteration 1 is the 2nd
    rows = re.findall(r"<tr>\s*<td><a class=\"episode-link\".*?</tr>", r.text, re.S)
    assert rows
    r = await browser.get(f"/console/episodes/{KILLED_EPISODE}")
    assert "2 turns" in r.text and "Turn 1<" in r.text.replace(" <small>", "<") and "Turn 0" not in r.text


async def test_reward_components_are_a_table_marking_the_weighted_ones(browser, app):
    rows = routes.reward_rows(
        {
            "tests_passed": {"value": 0.5, "ok": True, "details": {"passed": 1, "total": 2}},
            "coverage": {"value": 0.8, "ok": True},
        },
        {"tests_passed": 2.0},
    )
    assert [(r["name"], r["weight"], r["contribution"]) for r in rows] == [
        ("tests_passed", 2.0, 1.0),
        ("coverage", None, None),
    ]
    r = await browser.get(f"/console/episodes/{KILLED_EPISODE}")
    table = r.text[r.text.index('id="reward-vector"') :]
    table = table[: table.index("</table>")]
    assert '<tr class="weighted" data-component="tests_passed">' in table
    assert "× 1.0" in table and "<dt>passed</dt>" in table and "{&#34;" not in table  # no raw JSON


def test_the_band_stays_inside_the_reward_range():
    curve = [
        IterationReward(iteration=0, episodes=4, mean=0.1, std=0.3, min=0.0, max=0.6),
        IterationReward(iteration=1, episodes=4, mean=0.9, std=0.3, min=0.4, max=1.0),
    ]
    svg = str(reward_curve_svg(curve))
    ticks = [
        float(t) for t in re.findall(r'class="tick" x="\d+" y="[\d.]+" text-anchor="end">([-\d.e]+)<', svg)
    ]
    assert min(ticks) >= 0.0 and max(ticks) <= 1.0  # the axis covers what rewards were, not mean ± std
    band = re.search(r'class="band" points="([^"]+)"', svg).group(1)
    ys = [float(p.split(",")[1]) for p in band.split()]
    points = [float(y) for y in re.findall(r'class="point" cx="[\d.]+" cy="([\d.]+)"', svg)]
    top = min(float(y) for y in re.findall(r'class="grid" x1="\d+" x2="[\d.]+" y1="([\d.]+)"', svg))
    bottom = max(float(y) for y in re.findall(r'class="grid" x1="\d+" x2="[\d.]+" y1="([\d.]+)"', svg))
    assert all(top - 1 <= y <= bottom + 1 for y in ys + points)


def test_the_progress_line_counts_iterations_from_one_and_never_invents_a_mean():
    from temper.cli.jobs import progress_lines

    def metrics(iteration: int, curve: list[dict], state: str = "running") -> dict:
        return {
            "progress": {
                "state": state, "iteration": iteration, "iterations": 8, "fraction": 0.5, "finished": 4,
                "episodes_total": 8, "episodes_by_state": {"scored": 4},
            },
            "reward_curve": curve,
            "staleness": {"current_version": 1, "max": None, "in_flight_max": None, "max_staleness": 1},
            "throughput": {"episodes_per_min": 1.0},
        }  # fmt: skip

    job = {"id": "job-1", "name": "x"}
    lines = progress_lines(job, metrics(0, []), color=False)
    assert "iteration 1/8" in lines[0] and "mean reward – (nothing scored yet)" in lines[3]
    assert "0.000" not in lines[3]
    point = {"iteration": 0, "episodes": 4, "mean": 0.5, "std": 0.1, "min": 0.4, "max": 0.6}
    lines = progress_lines(job, metrics(1, [point]), color=False)
    assert "iteration 2/8" in lines[0]
    assert "mean reward 0.500 ± 0.100 (iteration 1), iteration 2: nothing scored yet" in lines[3]
    lines = progress_lines(job, metrics(7, [point], state="completed"), color=False)
    assert "iteration 8/8" in lines[0]


async def test_the_compare_page_overlays_reward_curves(browser, seeded):
    r = await browser.get("/console/")
    assert f'name="jobs" value="{seeded.job_id}"' in r.text and 'id="compare-submit"' in r.text
    r = await browser.get(
        "/console/compare", params=[("jobs", seeded.job_id), ("jobs", seeded.running_job_id)]
    )
    assert r.status_code == 200
    assert 'data-series="1"' in r.text  # the running job has nothing scored: no line for it
    assert f'data-job="{seeded.job_id}"' in r.text
    assert re.search(r'class="legend-label"[^>]*>add-numbers<title>', r.text), "the legend names the job"
    table = r.text[r.text.index('id="compare-table"') :]
    assert seeded.job_id in table and seeded.running_job_id in table
    assert len(re.findall(r'class="point"', r.text)) == 3
    r = await browser.get("/console/compare", params={"jobs": "job-nope"})
    assert r.status_code == 404 and "There is no job job-nope" in r.text
    r = await browser.get("/console/compare")
    assert r.status_code == 400 and "Pick the jobs" in r.text
    many = [("jobs", f"job-{i}") for i in range(routes.MAX_COMPARED + 1)]
    assert (await browser.get("/console/compare", params=many)).status_code == 400


def test_curves_of_several_jobs_share_one_axis():
    from services.dispatcher.console.charts import reward_curves_svg

    a = [IterationReward(iteration=i, episodes=2, mean=0.1 * i, std=0.0, min=0.0, max=0.5) for i in range(3)]
    b = [
        IterationReward(iteration=i, episodes=2, mean=0.2 + 0.1 * i, std=0.0, min=0.1, max=1.0)
        for i in range(5)
    ]
    svg = str(reward_curves_svg([("job-a", "alpha", a), ("job-c", "gamma", []), ("job-b", "beta", b)]))
    assert 'data-series="2"' in svg and svg.count('class="series"') == 2
    # colours by position, as the compare table shows them: job-c's stays unused
    assert 'data-job="job-a" stroke="#2f6fde"' in svg and 'data-job="job-b" stroke="#2b8a3e"' in svg
    labels = re.findall(r'text-anchor="middle">(\d+)</text>', svg)
    assert labels[0] == "1" and labels[-1] == "5"  # iterations counted from 1
    # each job's points in its own colour (a fill attribute lost to the console's CSS rule)
    assert svg.count('style="fill: #2f6fde"') == 3 and svg.count('style="fill: #2b8a3e"') == 5
    assert re.findall(r'class="legend-label"[^>]*>([^<]+)<title>([^<]+)', svg) == [
        ("alpha", "job-a"),
        ("beta", "job-b"),
    ]
