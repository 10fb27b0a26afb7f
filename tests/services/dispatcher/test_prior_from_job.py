"""``tasks.prior_from_job`` at the door: a job of the caller's tenant on the same task
set, else a 422 naming the field."""

from __future__ import annotations

import pytest

from temper.db import TaskSet
from tests.services.dispatcher.conftest import bearer
from tests.services.dispatcher.test_door import spec

pytestmark = pytest.mark.timeout(60)


def errors(r) -> dict[str, str]:
    assert r.status_code == 422, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


async def test_prior_from_job_must_be_a_job_of_yours_on_the_same_task_set(app, client, seeded):
    r = await client.post("/v1/jobs", json=spec(tasks__prior_from_job="job-nope"))
    assert errors(r)["tasks.prior_from_job"] == "unknown job 'job-nope': no job of yours has that id"
    # another tenant's job is unknown to you
    theirs = spec(tasks__taskset="ts-other", tasks__prior_from_job="job-finished")
    r = await client.post("/v1/jobs", json=theirs, headers=bearer(seeded.other_key))
    assert "unknown job 'job-finished'" in errors(r)["tasks.prior_from_job"]
    async with app.state.runtime.db.session() as s:
        s.add(TaskSet(id="ts-acme-2", tenant_id="acme", name="more", status="valid", task_count=0))
    r = await client.post(
        "/v1/jobs", json=spec(tasks__taskset="ts-acme-2", tasks__prior_from_job="job-finished")
    )
    assert errors(r)["tasks.prior_from_job"] == "job job-finished ran on task set 'ts-acme', not 'ts-acme-2'"
    r = await client.post("/v1/jobs", json=spec(tasks__prior_from_job="job-finished"))
    assert r.status_code == 201, r.text
    job = (await client.get(f"/v1/jobs/{r.json()['id']}")).json()
    assert job["spec"]["tasks"]["prior_from_job"] == "job-finished"
