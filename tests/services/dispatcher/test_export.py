"""Getting results out over REST: a finished job's trajectories exported as JSON lines
(streamed, paged) and as Parquet come back equal to the stored ones; checkpoints list
and download."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from services.dispatcher.api.export import parquet_records, trajectory_of
from temper.db import Database, Episode, PolicyVersion
from temper.storage import LocalStore
from temper.trajectory import Trajectory
from tests.services.dispatcher.conftest import bearer

pytestmark = pytest.mark.timeout(60)


async def stored(env) -> dict[str, Trajectory]:
    settings, seeded = env
    db, store = Database(settings.db), LocalStore(settings.storage.root)
    try:
        async with db.session() as s:
            rows = (
                await s.execute(
                    select(Episode).where(
                        Episode.job_id == seeded.job_id, Episode.trajectory_key.is_not(None)
                    )
                )
            ).scalars()
            return {e.id: Trajectory.model_validate_json(await store.get(e.trajectory_key)) for e in rows}
    finally:
        await db.dispose()


async def test_jsonl_export_round_trips_the_trajectories(client, env, seeded):
    expected = await stored(env)
    assert len(expected) == 12
    r = await client.get(f"/v1/jobs/{seeded.job_id}/trajectories")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert "X-Next-After" not in r.headers
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert [line["episode_id"] for line in lines] == sorted(expected)
    for line in lines:
        assert trajectory_of(line) == expected[line["episode_id"]]
        assert line["state"] in ("scored", "trained") and "behaviour_version" in line
        model = [s for s in line["segments"] if s["role"] == "model"]
        assert model and all(len(s["logprobs"]) == len(s["token_ids"]) for s in model)
        # each token names the version that sampled it, beside its logprob
        assert all(len(s["token_versions"]) == len(s["token_ids"]) for s in model)
        assert all(set(s["token_versions"]) <= {s["policy_version"]} for s in model)


async def test_jsonl_export_pages(client, seeded):
    got, after, pages = [], None, 0
    while True:
        params = {"limit": 5, **({"after": after} if after else {})}
        r = await client.get(f"/v1/jobs/{seeded.job_id}/trajectories", params=params)
        assert r.status_code == 200
        pages += 1
        got += [json.loads(line)["episode_id"] for line in r.text.splitlines()]
        after = r.headers.get("X-Next-After")
        if after is None:
            break
    assert pages == 3 and len(got) == len(set(got)) == 12 and got == sorted(got)


async def test_parquet_export_round_trips_the_trajectories(client, env, seeded):
    expected = await stored(env)
    r = await client.get(f"/v1/jobs/{seeded.job_id}/trajectories", params={"format": "parquet"})
    assert r.status_code == 200 and r.content.startswith(b"PAR1")
    rows = parquet_records(r.content)
    assert sorted(row["episode_id"] for row in rows) == sorted(expected)
    for row in rows:
        assert trajectory_of(row) == expected[row["episode_id"]]


async def test_export_refuses_what_it_cannot_do(client, seeded):
    assert (
        await client.get(f"/v1/jobs/{seeded.job_id}/trajectories", params={"format": "csv"})
    ).status_code == 422
    assert (
        await client.get(f"/v1/jobs/{seeded.job_id}/trajectories", params={"limit": 0})
    ).status_code == 422
    other = bearer(seeded.other_key)
    assert (await client.get(f"/v1/jobs/{seeded.job_id}/trajectories", headers=other)).status_code == 404
    assert (await client.get(f"/v1/jobs/{seeded.job_id}/checkpoints/1", headers=other)).status_code == 404


async def test_checkpoints_list_and_download(client, env, seeded):
    settings, _ = env
    db, store = Database(settings.db), LocalStore(settings.storage.root)
    key = f"acme/{seeded.job_id}/checkpoints/v1.safetensors"
    await store.put(key, b"weights of v1")
    try:
        async with db.session() as s:
            s.add(
                PolicyVersion(
                    job_id=seeded.job_id, version=1, checkpoint_key=key, step=1, metrics={"loss": 0.5}
                )
            )
    finally:
        await db.dispose()
    r = await client.get(f"/v1/jobs/{seeded.job_id}/checkpoints")
    assert r.status_code == 200
    assert [(c["version"], c["step"], c["metrics"]) for c in r.json()] == [(1, 1, {"loss": 0.5})]
    r = await client.get(f"/v1/jobs/{seeded.job_id}/checkpoints/1")
    assert r.status_code == 200 and r.content == b"weights of v1"
    assert "v1.safetensors" in r.headers["content-disposition"]
    assert (await client.get(f"/v1/jobs/{seeded.job_id}/checkpoints/2")).status_code == 404
