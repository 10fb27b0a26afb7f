"""The REST API over a migrated SQLite database: jobs, episodes, transcripts, metrics,
auth and tenant scoping."""

from __future__ import annotations

import statistics

import httpx
import pytest
import yaml
from sqlalchemy import select

from temper.db import Database, Episode, Job, OutboxRow, TrainedTrajectory
from temper.episode_log import read_episode_log
from temper.storage import LocalStore
from tests.services.dispatcher.conftest import KILLED_EPISODE, SPEC, bearer

pytestmark = pytest.mark.timeout(60)


def spec(**changes):
    data = yaml.safe_load(yaml.safe_dump(SPEC))
    data.update(changes)
    return data


async def test_submit_list_get_and_control_a_job(client, env):
    r = await client.post("/v1/jobs", json=spec(name="first"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "pending" and job["name"] == "first" and job["iterations"] == 3
    assert job["spec"]["algorithm"]["name"] == "grpo"  # defaults filled in

    r = await client.get(f"/v1/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["id"] == job["id"]

    page = (await client.get("/v1/jobs", params={"state": "pending"})).json()
    assert [j["id"] for j in page["items"]] == [job["id"]] and page["total"] == 1
    assert (await client.get("/v1/jobs", params={"name": "FIRS"})).json()["total"] == 1

    assert (await client.post(f"/v1/jobs/{job['id']}/pause")).status_code == 409  # pending cannot pause
    assert (await client.post(f"/v1/jobs/{job['id']}/resume")).json()["state"] == "running"
    assert (await client.post(f"/v1/jobs/{job['id']}/pause")).json()["state"] == "paused"
    assert (await client.post(f"/v1/jobs/{job['id']}/resume")).json()["state"] == "running"
    r = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.json()["state"] == "cancelled" and r.json()["finished_at"]
    r = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]

    settings, _ = env
    db = Database(settings.db)
    async with db.session() as s:
        events = [
            row.payload
            for row in (await s.execute(select(OutboxRow).where(OutboxRow.key == job["id"]))).scalars()
        ]
    await db.dispose()
    assert len(events) == 5 and b'"state":"pending"' in events[0] and b'"state":"cancelled"' in events[-1]


async def test_cancel_cancels_the_jobs_unfinished_episodes(client, env, seeded):
    r = await client.post(f"/v1/jobs/{seeded.running_job_id}/cancel")
    assert r.status_code == 200
    states = (await client.get(f"/v1/jobs/{seeded.running_job_id}/episodes")).json()["items"]
    assert {e["id"]: e["state"] for e in states} == {"ep-live": "cancelled", "ep-live-2": "cancelled"}
    assert all(e["state_reason"] == "job cancelled" for e in states)


async def test_pagination_by_cursor_and_offset(client):
    ids = []
    for i in range(5):
        ids.append((await client.post("/v1/jobs", json=spec(name=f"page-{i}"))).json()["id"])
    seen, cursor = [], None
    while True:
        params = {"limit": 2, "name": "page-"} | ({"cursor": cursor} if cursor else {})
        page = (await client.get("/v1/jobs", params=params)).json()
        assert page["total"] == 5
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == list(reversed(ids))  # newest first, each once
    page = (await client.get("/v1/jobs", params={"limit": 2, "offset": 4, "name": "page-"})).json()
    assert [j["id"] for j in page["items"]] == [ids[0]]
    assert (await client.get("/v1/jobs", params={"cursor": "garbage!"})).status_code == 400


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"schedule": {"iterations": 0}}, "schedule.iterations"),
        ({"policy": {"model": "m", "sampling": {"temperature": -1}}}, "policy.sampling.temperature"),
        ({"tasks": {"taskset": "ts-acme", "group_size": 3}}, "(root)"),
        ({"environment": {"kind": "code", "max_turn": 2}}, "environment.max_turn"),
        ({"tasks": {"taskset": "ts-other"}}, "tasks.taskset"),  # another tenant's task set
        ({"tasks": {"taskset": "nope"}}, "tasks.taskset"),
    ],
)
async def test_a_bad_spec_is_refused_naming_the_field(client, changes, field):
    r = await client.post("/v1/jobs", json=spec(**changes))
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json()["errors"]]
    assert field in fields, r.json()
    assert (await client.get("/v1/jobs", params={"state": "pending"})).json()["total"] == 0


async def test_missing_fields_are_each_named(client):
    r = await client.post("/v1/jobs", json={"name": "x"})
    assert r.status_code == 422
    assert {e["field"] for e in r.json()["errors"]} == {"policy", "tasks"}
    r = await client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "(document)"


async def test_yaml_body_and_yaml_file_upload(client):
    text = yaml.safe_dump(spec(name="from-yaml"))
    r = await client.post("/v1/jobs", content=text, headers={"content-type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "from-yaml"
    r = await client.post(
        "/v1/jobs", files={"spec": ("spec.yaml", yaml.safe_dump(spec(name="uploaded")), "application/yaml")}
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "uploaded"
    bad = yaml.safe_dump(spec(schedule={"max_staleness": -1}))
    r = await client.post("/v1/jobs", files={"spec": ("spec.yaml", bad, "application/yaml")})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "schedule.max_staleness"
    r = await client.post("/v1/jobs", content=b"x", headers={"content-type": "image/png"})
    assert r.status_code == 415


async def test_errors_read_one_line_in_the_docs_words(client):
    # a tab in YAML: one line saying where, not the parser's five lines naming its input
    tabbed = yaml.safe_dump(spec(name="tabs")).replace("\nschedule:", "\n\tschedule:", 1)
    r = await client.post("/v1/jobs", content=tabbed, headers={"content-type": "application/yaml"})
    detail = r.json()["detail"]
    assert r.status_code == 422 and "\n" not in detail, detail
    assert "line " in detail and ", column 1: found character '\\t'" in detail, detail
    assert "<unicode string>" not in detail and "<byte string>" not in detail
    # a validator's own message, without pydantic's "Value error, " prefix
    both = spec(
        name="both",
        environment={
            "kind": "math",
            "tools": [{"function": {"name": "bash"}, "run": "bash", "command": "x"}],
        },
    )
    r = await client.post("/v1/jobs", json=both)
    assert r.status_code == 422, r.text
    messages = [e["message"] for e in r.json()["errors"]]
    assert "give run or command, not both" in messages and not any("Value error" in m for m in messages)


async def test_no_key_or_a_bad_key_is_401(app, seeded):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as c:
        for headers in (
            {},
            bearer("tmp_wrong"),
            {"Authorization": "Basic abc"},
            {"Authorization": "Bearer "},
        ):
            r = await c.get("/v1/jobs", headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await c.post("/v1/jobs", json=spec())).status_code == 401
        assert (await c.get(f"/v1/episodes/{seeded.episodes[0]}/transcript")).status_code == 401
        assert (await c.get("/health")).status_code == 200  # operations stay open


async def test_another_tenants_jobs_and_episodes_are_404(app, seeded):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://d", headers=bearer(seeded.other_key)
    ) as c:
        assert (await c.get("/v1/jobs")).json()["total"] == 0
        for path in (
            f"/v1/jobs/{seeded.job_id}",
            f"/v1/jobs/{seeded.job_id}/metrics",
            f"/v1/jobs/{seeded.job_id}/episodes",
            f"/v1/episodes/{seeded.episodes[0]}",
            f"/v1/episodes/{seeded.episodes[0]}/transcript",
            f"/v1/episodes/{seeded.episodes[0]}/trajectory",
        ):
            assert (await c.get(path)).status_code == 404, path
        assert (await c.post(f"/v1/jobs/{seeded.running_job_id}/cancel")).status_code == 404


async def test_episode_filters(client, seeded):
    base = f"/v1/jobs/{seeded.job_id}/episodes"
    assert (await client.get(base)).json()["total"] == 12
    r = (await client.get(base, params={"task": "add-2", "min_reward": 0.5})).json()
    assert {e["id"] for e in r["items"]} == {"ep-1-add-2-0", "ep-2-add-2-0", "ep-2-add-2-1"}
    r = (await client.get(base, params={"max_reward": 0.0, "iteration": 1})).json()
    assert [e["id"] for e in r["items"]] == ["ep-1-add-2-1"]
    assert (await client.get(base, params={"state": "scored"})).json()["total"] == 0
    assert (await client.get(base, params={"state": "bogus"})).status_code == 422
    first = (await client.get(base, params={"limit": 5})).json()
    second = (await client.get(base, params={"limit": 5, "cursor": first["next_cursor"]})).json()
    assert len({e["id"] for e in first["items"] + second["items"]}) == 10


async def test_transcript_from_the_stored_trajectory(client):
    r = await client.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")
    assert r.status_code == 200, r.text
    t = r.json()
    assert t["source"] == "trajectory" and t["episode"]["id"] == KILLED_EPISODE
    first, second = t["turns"]
    assert first["prompt"].startswith("Write a function add(a, b)") and first["prompt_tokens"] > 10
    assert "def add(a, b)" in first["action_text"] and first["action"]["language"] == "python"
    assert first["kill_reason"] == "timeout" and "killed" in first["observation"]
    assert first["policy_version"] == 0 and first["timings"]["sandbox_s"] == 2.0
    assert second["prompt"] == first["observation"] and second["exit_code"] == 0
    assert t["rewards"]["tests_passed"]["details"] == {"passed": 0, "total": 2}
    assert t["policy_versions"] == [0] and t["final_observation"] == ""
    raw = await client.get(f"/v1/episodes/{KILLED_EPISODE}/trajectory")
    assert raw.status_code == 200 and raw.json()["segments"][1]["logprobs"][0] == -0.5


async def test_the_episode_log_is_linked_once_stored(client, env):
    assert (await client.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")).json()["log_key"] is None
    assert (await client.get(f"/v1/episodes/{KILLED_EPISODE}/log")).status_code == 404
    settings, _ = env
    key = f"tenants/acme/jobs/job-finished/logs/{KILLED_EPISODE}.jsonl"
    await LocalStore(settings.storage.root).put(
        key, b'{"turn": 0, "kind": "sandbox", "kill_reason": "timeout"}\n'
    )
    assert (await client.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")).json()["log_key"] == key
    r = await client.get(f"/v1/episodes/{KILLED_EPISODE}/log")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert read_episode_log(r.content) == [{"turn": 0, "kind": "sandbox", "kill_reason": "timeout"}]


async def test_transcript_of_an_episode_in_progress_comes_from_its_steps(client):
    t = (await client.get("/v1/episodes/ep-live/transcript")).json()
    assert t["source"] == "steps"
    (turn,) = t["turns"]
    assert turn["prompt"].startswith("Write a function") and "ls" in turn["action_text"]
    assert turn["action"] == {"kind": "shell", "command": "ls"} and turn["observation"] == ""
    assert turn["policy_version"] == 1
    assert (await client.get("/v1/episodes/ep-live/trajectory")).status_code == 404


async def test_metrics_of_a_finished_job(client, seeded):
    r = await client.get(f"/v1/jobs/{seeded.job_id}/metrics")
    assert r.status_code == 200, r.text
    m = r.json()
    curve = m["reward_curve"]
    assert [p["iteration"] for p in curve] == [0, 1, 2]
    for point in curve:
        rewards = seeded.rewards[point["iteration"]]
        assert point["episodes"] == 4
        assert point["mean"] == pytest.approx(statistics.fmean(rewards))
        assert point["std"] == pytest.approx(statistics.pstdev(rewards), abs=1e-6)
    assert curve[0]["mean"] < curve[1]["mean"] < curve[2]["mean"]
    rates = {p["task_id"]: p for p in m["pass_rates"]}
    assert rates["add-1"]["passed"] == 2 and rates["add-1"]["pass_rate"] == pytest.approx(2 / 6)
    assert rates["add-2"]["passed"] == 1
    loose = (await client.get(f"/v1/jobs/{seeded.job_id}/metrics", params={"pass_threshold": 0.5})).json()
    assert {p["task_id"]: p["passed"] for p in loose["pass_rates"]} == {"add-1": 4, "add-2": 3}
    p = m["progress"]
    assert p["episodes_by_state"] == {"trained": 12} and p["finished"] == 12 and p["fraction"] == 1.0
    assert p["iteration"] == 3 and p["iterations"] == 3 and p["episodes_total"] == 12
    assert m["throughput"]["episodes_finished"] == 12 and m["throughput"]["episodes_per_min"] > 1
    assert m["staleness"]["current_version"] == 3 and m["staleness"]["max_staleness"] == 1


async def test_metrics_of_a_running_job(client, seeded):
    m = (await client.get(f"/v1/jobs/{seeded.running_job_id}/metrics")).json()
    assert m["reward_curve"] == [] and m["pass_rates"] == []
    assert m["progress"]["episodes_by_state"] == {"acting": 1, "pending": 1}
    assert m["staleness"]["in_flight_max"] == 0


async def test_staleness_counts_scored_episodes_waiting_for_the_trainer_not_skipped_ones(env, client, seeded):
    settings, _ = env
    db = Database(settings.db)
    async with db.session() as s:
        job = await s.get(Job, seeded.running_job_id)
        job.policy_version = 5
        for eid, behaviour in (("ep-waiting", 3), ("ep-skipped", 0)):
            s.add(
                Episode(
                    id=eid,
                    job_id=job.id,
                    tenant_id="acme",
                    task_id="add-1",
                    group_id=f"g-{eid}",
                    iteration=0,
                    state="scored",
                    turn=1,
                    behaviour_version=behaviour,
                )
            )
        await s.flush()
        s.add(
            TrainedTrajectory(
                episode_id="ep-skipped",
                job_id=job.id,
                trajectory_key="k",
                group_id="g-ep-skipped",
                skipped="zero_variance",
            )
        )
    await db.dispose()
    st = (await client.get(f"/v1/jobs/{seeded.running_job_id}/metrics")).json()["staleness"]
    assert (st["max"], st["mean"]) == (2, 2.0), "the skipped episode (5 versions behind) is not waiting"


async def test_tenant_quota_keys_and_admin(app, client, seeded):
    me = (await client.get("/v1/tenant")).json()
    assert me["id"] == "acme" and me["max_concurrent_episodes"] == 8 and me["active_episodes"] == 2
    assert me["admin"] is False
    new = (await client.post("/v1/keys", json={"name": "ci"})).json()
    assert new["key"].startswith("tmp_") and new["prefix"] == new["key"][:12]
    listed = (await client.get("/v1/keys")).json()
    assert all("key" not in k and "key_hash" not in k for k in listed) and len(listed) == 2
    assert (await client.get("/v1/tenant", headers=bearer(new["key"]))).status_code == 200
    assert (await client.delete(f"/v1/keys/{new['id']}")).status_code == 204
    assert (await client.get("/v1/tenant", headers=bearer(new["key"]))).status_code == 401
    assert (await client.post("/v1/tenants", json={"name": "Nope"})).status_code == 403

    admin = bearer(seeded.admin_key)
    r = await client.post(
        "/v1/tenants", json={"name": "New Team", "max_concurrent_episodes": 4}, headers=admin
    )
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["tenant"]["id"] == "new-team" and made["key"]["key"].startswith("tmp_")
    assert (await client.post("/v1/tenants", json={"name": "New Team"}, headers=admin)).status_code == 409
    r = await client.patch("/v1/tenants/acme", json={"max_concurrent_episodes": 32}, headers=admin)
    assert r.json()["max_concurrent_episodes"] == 32
    assert (await client.get("/v1/tenant")).json()["max_concurrent_episodes"] == 32
    ids = [t["id"] for t in (await client.get("/v1/tenants", headers=admin)).json()]
    assert ids == ["acme", "new-team", "ops", "other"]


async def test_bootstrap_key_creates_the_default_tenant_once(tmp_path):
    import asyncio

    from services.dispatcher.app import create_app
    from temper.db.migrate import upgrade
    from tests.services.dispatcher.conftest import make_settings

    settings = make_settings(tmp_path, bootstrap_key="tmp_bootstrap-secret-value")
    await asyncio.to_thread(upgrade, settings.db.url)
    for _ in range(2):  # a restart finds it in place
        app = create_app(settings, run_episodes=False)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://d") as c:
                me = (await c.get("/v1/tenant", headers=bearer("tmp_bootstrap-secret-value"))).json()
                assert me["id"] == "default" and me["admin"] is True


async def test_episode_rows_are_not_changed_by_reads(client, env, seeded):
    await client.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")
    await client.get(f"/v1/jobs/{seeded.job_id}/metrics")
    settings, _ = env
    db = Database(settings.db)
    async with db.session() as s:
        ep = await s.get(Episode, KILLED_EPISODE)
        assert ep.state == "trained"
    await db.dispose()


async def test_tasksets_are_mounted_behind_the_same_auth(app, client, seeded):
    listed = (await client.get("/v1/tasksets")).json()
    assert [t["id"] for t in listed] == ["ts-acme"]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as anonymous:
        assert (await anonymous.get("/v1/tasksets")).status_code == 401
