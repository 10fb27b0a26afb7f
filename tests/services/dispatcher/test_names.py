"""Task sets by the names people give them: a job spec, ``GET /v1/tasksets/{ref}`` and its
tasks take a task set's name wherever they take its id; the job keeps the id it resolved
to; a name that several of the tenant's task sets carry is refused listing their ids."""

from __future__ import annotations

import json

import pytest

from temper.db import Database, Episode, Job, TaskSet, Tenant
from tests.services.dispatcher.test_dispatcher_cli import run_cli, server  # noqa: F401
from tests.services.dispatcher.test_door import spec

pytestmark = pytest.mark.timeout(60)


async def test_a_task_set_name_stands_for_its_id(client, env):
    r = await client.post("/v1/jobs", json=spec(tasks__taskset="adders"))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["tasks"]["taskset"] == "ts-acme", "the job is pinned to the id"
    by_name = (await client.get("/v1/tasksets/adders")).json()
    by_id = (await client.get("/v1/tasksets/ts-acme")).json()
    assert by_name == by_id and by_id["id"] == "ts-acme"
    assert (await client.get("/v1/tasksets/adders/tasks")).json() == (
        await client.get("/v1/tasksets/ts-acme/tasks")
    ).json()
    assert (await client.get("/v1/tasksets/theirs")).status_code == 404  # another tenant's name


async def test_a_name_of_two_task_sets_is_refused_naming_both(client, env):
    settings, _ = env
    db = Database(settings.db)
    try:
        async with db.session() as s:
            s.add(TaskSet(id="ts-acme-2", tenant_id="acme", name="adders", status="valid", task_count=2))
    finally:
        await db.dispose()
    r = await client.post("/v1/jobs", json=spec(tasks__taskset="adders"))
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [
        {
            "field": "tasks.taskset",
            "message": "task set name 'adders' names 2 task sets of yours (ts-acme, ts-acme-2); give the id",
        }
    ]
    r = await client.get("/v1/tasksets/adders")
    assert r.status_code == 409 and "(ts-acme, ts-acme-2)" in r.text, r.text
    assert (await client.post("/v1/jobs", json=spec(tasks__taskset="ts-acme-2"))).status_code == 201


async def test_episodes_of_a_task_by_its_key_or_its_full_id(client, env, seeded):
    settings, _ = env
    db = Database(settings.db)
    try:
        async with db.session() as s:
            job = await s.get(Job, seeded.job_id)
            assert job.spec["tasks"]["taskset"] == "ts-acme"
            s.add(Episode(id="ep-full-id", job_id=job.id, tenant_id="acme", task_id="ts-acme:add-9",
                          group_id="g-full", state="trained", reward=1.0))  # fmt: skip
    finally:
        await db.dispose()
    base = f"/v1/jobs/{seeded.job_id}/episodes"
    for task in ("add-9", "ts-acme:add-9"):
        assert [e["id"] for e in (await client.get(base, params={"task": task})).json()["items"]] == [
            "ep-full-id"
        ]
    assert (await client.get(base, params={"task": "add-"})).json()["total"] == 0  # whole keys only


async def test_a_job_by_its_name_and_a_shared_name_refused(client, seeded):
    by_name = (await client.get("/v1/jobs/add-numbers")).json()
    assert by_name["id"] == seeded.job_id
    r = await client.get("/v1/jobs/add-numbers/metrics")
    assert r.status_code == 200 and r.json()["job_id"] == seeded.job_id
    r = await client.post("/v1/jobs", json=spec(name="add-numbers"))  # the spec's name stays free
    assert r.status_code == 201, r.text
    again = r.json()["id"]
    r = await client.get("/v1/jobs/add-numbers")
    assert r.status_code == 409, r.text
    assert (
        r.json()["detail"]
        == f"job name 'add-numbers' names 2 jobs of yours ({again}, {seeded.job_id}); give the id"
    )
    assert (await client.get(f"/v1/jobs/{again}")).status_code == 200
    assert (await client.get("/v1/jobs/add-number")).status_code == 404


def test_the_cli_takes_a_job_name(server, capsys):  # noqa: F811
    url, seeded = server
    code, out, err = run_cli(["--url", url, "--key", seeded.key, "metrics", "add-numbers"], capsys)
    assert code == 0, err
    assert "reward per iteration" in out


async def test_a_handle_names_one_job_tags_find_jobs_and_a_note_changes(client, seeded):
    r = await client.post(
        "/v1/jobs", json=spec(name="add-numbers", handle="add-v2", tags=["grpo", "lr=1e-5"])
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["handle"], job["tags"], job["note"]) == ("add-v2", ["grpo", "lr=1e-5"], None)
    # the handle works where the id does, though the name is now shared with the seeded job
    assert (await client.get("/v1/jobs/add-v2")).json()["id"] == job["id"]
    assert (await client.get("/v1/jobs/add-v2/metrics")).json()["job_id"] == job["id"]
    assert (await client.get("/v1/jobs/add-numbers")).status_code == 409
    # one handle, one job: the same spec again is refused naming the job that has it
    r = await client.post("/v1/jobs", json=spec(name="again", handle="add-v2"))
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [
        {"field": "handle", "message": f"handle 'add-v2' is taken by job {job['id']}"}
    ]
    for bad, says in (("job-abc", "must not start with 'job-'"), ("Add V2", "should match pattern")):
        r = await client.post("/v1/jobs", json=spec(name="x", handle=bad))
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "handle" and says in r.text, r.text
    r = await client.post("/v1/jobs", json=spec(name="x", tags=['a"b']))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "tags.0", r.text

    listed = (await client.get("/v1/jobs", params={"tag": "grpo"})).json()
    assert [j["id"] for j in listed["items"]] == [job["id"]] and listed["total"] == 1
    assert (await client.get("/v1/jobs", params={"tag": "grp"})).json()["total"] == 0  # whole tags only
    assert (await client.get("/v1/jobs", params={"tag": "lr=1e-5"})).json()["total"] == 1

    r = await client.patch("/v1/jobs/add-v2", json={"note": "lower lr than v1", "tags": ["grpo", "keep"]})
    assert r.status_code == 200, r.text
    assert (r.json()["note"], r.json()["tags"], r.json()["handle"]) == (
        "lower lr than v1",
        ["grpo", "keep"],
        "add-v2",
    )
    r = await client.patch(f"/v1/jobs/{job['id']}", json={"note": None})
    assert r.status_code == 200 and r.json()["note"] is None and r.json()["tags"] == ["grpo", "keep"]
    r = await client.patch(f"/v1/jobs/{job['id']}", json={"handle": "other"})
    assert r.status_code == 422, "the handle never changes"


async def test_tags_and_handles_on_both_databases(database_url):
    """The tag filter (a JSON column read as text) and the handle's unique index behave the
    same on SQLite and Postgres; a handle taken between the check and the insert (two
    submissions racing) is the same 422, not a server error."""
    import asyncio

    from services.dispatcher.api import repo
    from temper.db.migrate import upgrade
    from temper.jobspec import JobSpec, SpecError
    from temper.settings import DatabaseSettings
    from temper.tenants import create_tenant

    await asyncio.to_thread(upgrade, database_url)
    db = Database(DatabaseSettings(url=database_url))
    try:
        async with db.session() as s:
            await create_tenant(s, name="Acme", tenant_id="acme")
            s.add(TaskSet(id="ts-acme", tenant_id="acme", name="adders", status="valid", task_count=2))
        async with db.session() as s:
            tenant = await s.get(Tenant, "acme")
            for name, handle, tags in (("a", "one", ["grpo", "x"]), ("b", None, ["grpo-2"]), ("c", None, [])):
                await repo.create_job(s, tenant=tenant, spec=JobSpec.model_validate(
                    spec(name=name, handle=handle, tags=tags, tasks__taskset="ts-acme")))  # fmt: skip
        async with db.session() as s:
            page = await repo.list_jobs(s, tenant_id="acme", tag="grpo")
            assert [j.name for j in page.rows] == ["a"] and page.total == 1
            assert (await repo.list_jobs(s, tenant_id="acme", tag="grpo-2")).total == 1
            assert [j.name for j in await repo.find_job(s, tenant_id="acme", ref="one")] == ["a"]
        # the check passed (no job had the handle when it looked), the unique index refuses
        async with db.session() as s:
            tenant = await s.get(Tenant, "acme")
            first = JobSpec.model_validate(spec(name="d", handle="two", tasks__taskset="ts-acme"))
            await repo.create_job(s, tenant=tenant, spec=first)
        raced = JobSpec.model_validate(spec(name="e", handle="two", tasks__taskset="ts-acme"))
        real = repo.job_by_handle
        repo.job_by_handle = lambda *a, **k: asyncio.sleep(0)  # type: ignore[assignment]  # the check missed it
        try:
            with pytest.raises(SpecError, match="handle 'two' is taken"):
                async with db.session() as s:
                    await repo.create_job(s, tenant=await s.get(Tenant, "acme"), spec=raced)
        finally:
            repo.job_by_handle = real  # type: ignore[assignment]
        async with db.session() as s:
            assert [j.name for j in await repo.find_job(s, tenant_id="acme", ref="two")] == ["d"]
    finally:
        await db.dispose()


def test_the_cli_lists_by_tag_and_changes_tags_and_notes(server, capsys):  # noqa: F811
    from temper.client import TemperClient

    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    with TemperClient(url=url, key=seeded.key) as api:
        job = api.submit(spec(name="tagged", handle="tagged-1", tags=["sweep"]))
    code, out, err = run_cli([*base, "jobs", "--tag", "sweep"], capsys)
    assert code == 0, err
    header, row = out.splitlines()[:2]
    assert header.split() == ["JOB", "HANDLE", "NAME", "STATE", "ITERATION", "POLICY", "CREATED", "TAGS"]
    assert row.split()[:3] == [job["id"], "tagged-1", "tagged"] and row.split()[-1] == "sweep"
    code, out, err = run_cli(
        [*base, "tag", "tagged-1", "--set", "sweep", "best", "--note", "keep this one"], capsys
    )
    assert code == 0 and out.strip() == f"{job['id']} tags: sweep,best; note: keep this one", err
    code, out, _ = run_cli([*base, "jobs", "--tag", "best", "--json"], capsys)
    assert [(j["id"], j["note"]) for j in json.loads(out)["items"]] == [(job["id"], "keep this one")]
    assert run_cli([*base, "tag", "tagged-1"], capsys)[0] == 2  # nothing to change
