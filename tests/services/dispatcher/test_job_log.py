"""A job's log lines: ``GET /v1/jobs/{ref}/log`` reads the services' one log file back from
its end and answers the lines carrying the job's id (no other job's, no other tenant's);
without one log file it says where the lines are instead (501)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.dispatcher.api import job_log
from tests.services.dispatcher.conftest import bearer
from tests.services.dispatcher.test_dispatcher_cli import server  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def line(ts: str, job: str | None, msg: str) -> str:
    entry = {"ts": ts, "level": "info", "service": "dispatcher", "logger": "temper.scheduler", "msg": msg}
    if job:
        entry["job_id"] = job
    return json.dumps(entry)


def write_log(path, jobs: list[str | None], n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            job = jobs[i % len(jobs)]
            f.write(line(f"2026-12-04T00:00:{i // 100:02d}.{i % 100:03d}Z", job, f"line {i} of {job}") + "\n")
        f.write("not json, but job-a is named in it\n")


def test_lines_of_one_job_read_back_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(job_log, "CHUNK", 97)  # many chunk borders, lines cut by them
    path = tmp_path / "temper.log"
    write_log(path, ["job-a", "job-b", None, "job-ab"], 400)
    got = [json.loads(x) for x in job_log.job_lines(path, "job-a", tail=5)]
    assert [g["msg"] for g in got] == [f"line {i} of job-a" for i in range(380, 400, 4)]
    everything = job_log.job_lines(path, "job-a", tail=1000)
    assert len(everything) == 100 and all(
        json.loads(x)["job_id"] == "job-a" for x in everything
    )  # not job-ab
    after = json.loads(everything[-3])["ts"]
    assert [json.loads(x)["msg"] for x in job_log.job_lines(path, "job-a", tail=1000, after=after)] == [
        "line 392 of job-a",
        "line 396 of job-a",
    ]


async def test_the_route_answers_the_jobs_lines_and_501_without_a_log_file(env, tmp_path):
    from services.dispatcher.app import create_app

    settings, seeded = env
    path = tmp_path / "services.log"
    write_log(path, [seeded.job_id, seeded.running_job_id], 20)
    for log_file, expect in ((path, 200), (None, 501)):
        app = create_app(settings.model_copy(update={"log": settings.log.model_copy(update={"file": log_file})}),
                         run_episodes=False)  # fmt: skip
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://d", headers=bearer(seeded.key)
            ) as c:
                r = await c.get(f"/v1/jobs/{seeded.job_id}/log", params={"tail": 3})
                assert r.status_code == expect, r.text
                if expect == 200:
                    assert r.headers["content-type"] == "application/x-ndjson"
                    got = [json.loads(x) for x in r.text.splitlines()]
                    assert [g["msg"] for g in got] == [f"line {i} of {seeded.job_id}" for i in (14, 16, 18)]
                    other = await c.get(f"/v1/jobs/{seeded.job_id}/log", headers=bearer(seeded.other_key))
                    assert other.status_code == 404
                else:
                    assert f"job_id {seeded.job_id}" in r.json()["detail"] and "TEMPER_LOG__FILE" in r.text


def test_temper_logs_takes_an_episode_or_a_job(server, capsys):  # noqa: F811
    from tests.services.dispatcher.conftest import KILLED_EPISODE
    from tests.services.dispatcher.test_dispatcher_cli import run_cli

    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    code, out, err = run_cli([*base, "logs", KILLED_EPISODE], capsys)
    assert code != 0 and f"episode {KILLED_EPISODE} has no log" in err  # an episode: not taken for a job
    code, out, err = run_cli([*base, "logs", "add-numbers"], capsys)  # a job, by name
    assert code != 0 and "TEMPER_LOG__FILE" in err and seeded.job_id in err  # this server logs to its stream
