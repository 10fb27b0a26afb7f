"""A job whose sandbox limits (the environment's, or a task's) go above the operator's
maxima, or ask for the host's network, is refused at submission with the field and the
setting named: never clamped later by the worker."""

from __future__ import annotations

import pytest
import yaml

from temper.db import Database, Task
from tests.services.dispatcher.conftest import SPEC

pytestmark = pytest.mark.timeout(60)


def spec(**env: object) -> dict:
    data = yaml.safe_load(yaml.safe_dump(SPEC))
    data["environment"].update(env)
    return data


async def test_environment_limits_above_the_maxima_are_refused(client) -> None:
    r = await client.post("/v1/jobs", json=spec(limits={"memory_mb": 32768, "pids": 8192, "wall_s": 30}))
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert "memory_mb=32768 is above the operator's maximum 16384" in errors["environment.limits.memory_mb"]
    assert "TEMPER_SANDBOX__MAX_LIMITS__PIDS" in errors["environment.limits.pids"]
    assert "environment.limits.wall_s" not in errors
    r = await client.post("/v1/jobs", json=spec(limits={"network": "host"}))
    assert r.status_code == 422 and "ALLOW_HOST_NETWORK" in r.text
    r = await client.post("/v1/jobs", json=spec(limits={"network": "allowlist"}))
    assert r.status_code == 422 and "needs at least one host:port" in r.text
    r = await client.post(
        "/v1/jobs",
        json=spec(limits={"memory_mb": 16384, "network": "allowlist", "allow": ["pypi.org:443"]}),
    )
    assert r.status_code == 201, r.text


async def test_a_task_asking_above_the_maxima_is_refused(client, env) -> None:
    settings, _ = env
    db = Database(settings.db)
    async with db.session() as s:
        s.add(
            Task(
                id="ts-acme:greedy", task_set_id="ts-acme", key="greedy", kind="shell", prompt="p",
                spec={"tests": "assert True", "limits": {"workspace_mb": 20000, "network": False}},
                status="valid",
            )
        )  # fmt: skip
    await db.dispose()
    r = await client.post("/v1/jobs", json=spec())
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert "a task's limits: workspace_mb=20000 is above" in errors["tasks.taskset"]
    # The environment's limits override the task's: asking within the maximum passes.
    r = await client.post("/v1/jobs", json=spec(limits={"workspace_mb": 1024}))
    assert r.status_code == 201, r.text
