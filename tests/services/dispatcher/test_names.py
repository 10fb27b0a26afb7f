"""Task sets by the names people give them: a job spec, ``GET /v1/tasksets/{ref}`` and its
tasks take a task set's name wherever they take its id; the job keeps the id it resolved
to; a name that several of the tenant's task sets carry is refused listing their ids."""

from __future__ import annotations

import pytest

from temper.db import Database, Episode, Job, TaskSet
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
