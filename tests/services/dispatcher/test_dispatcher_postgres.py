"""The API against the real Postgres (`make stack-up`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.dispatcher.app import create_app
from temper.db import Database
from temper.db.migrate import upgrade
from temper.settings import DatabaseSettings
from temper.storage import LocalStore
from tests.services.dispatcher.conftest import KILLED_EPISODE, SPEC, bearer, make_settings, seed

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_the_api_on_postgres(database_url, tmp_path):
    await asyncio.to_thread(upgrade, database_url)
    settings = make_settings(tmp_path)
    settings.db = DatabaseSettings(url=database_url)
    db = Database(settings.db)
    seeded = await seed(db, LocalStore(settings.storage.root))
    await db.dispose()

    app = create_app(settings, run_episodes=False)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://d", headers=bearer(seeded.key)
        ) as c:
            r = await c.post("/v1/jobs", json=SPEC | {"name": "on-postgres"})
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            assert (
                await c.post("/v1/jobs", json=SPEC | {"tasks": {"taskset": "ts-other"}})
            ).status_code == 422
            page = (await c.get("/v1/jobs", params={"limit": 1})).json()
            assert page["total"] == 3 and page["items"][0]["id"] == job_id and page["next_cursor"]
            nxt = (await c.get("/v1/jobs", params={"limit": 5, "cursor": page["next_cursor"]})).json()
            assert [j["id"] for j in nxt["items"]] == [seeded.running_job_id, seeded.job_id]
            assert (await c.post(f"/v1/jobs/{seeded.running_job_id}/cancel")).json()["state"] == "cancelled"

            m = (await c.get(f"/v1/jobs/{seeded.job_id}/metrics")).json()
            assert [round(p["mean"], 3) for p in m["reward_curve"]] == [0.0, 0.375, 0.875]
            assert {p["task_id"]: p["passed"] for p in m["pass_rates"]} == {"add-1": 2, "add-2": 1}
            eps = (await c.get(f"/v1/jobs/{seeded.job_id}/episodes", params={"min_reward": 1.0})).json()
            assert eps["total"] == 3
            t = (await c.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")).json()
            assert t["turns"][0]["kill_reason"] == "timeout"

        async with httpx.AsyncClient(
            transport=transport, base_url="http://d", headers=bearer(seeded.other_key)
        ) as c:
            assert (await c.get(f"/v1/jobs/{seeded.job_id}")).status_code == 404
            assert (await c.get(f"/v1/episodes/{KILLED_EPISODE}/transcript")).status_code == 404
