"""A job whose environment or tasks name a task image is refused at submission when the
image is not published in the object store, naming the field and the digest."""

from __future__ import annotations

import io
import tarfile

import pytest
import yaml

from temper.db import Database, Task
from temper.sandbox.images import blob_key, publish
from temper.storage import LocalStore
from tests.services.dispatcher.conftest import SPEC

pytestmark = pytest.mark.timeout(60)
MISSING = "sha256:" + "ab" * 32


def tiny_image() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("usr/bin/python3")
        info.type, info.linkname = tarfile.SYMTYPE, "python3.11"
        tar.addfile(info)
    return buf.getvalue()


def spec(**env: object) -> dict:
    data = yaml.safe_load(yaml.safe_dump(SPEC))
    data["environment"].update(env)
    return data


async def test_environment_image_must_be_published(client, env) -> None:
    settings, _ = env
    store = LocalStore(settings.storage.root)
    r = await client.post("/v1/jobs", json=spec(limits={"image": MISSING}))
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert f"image {MISSING} is not in object storage" in errors["environment.limits.image"]
    r = await client.post("/v1/jobs", json=spec(limits={"image": "debian:latest"}))
    assert r.status_code == 422 and "invalid image digest" in r.text

    digest = await publish(store, tiny_image(), source={"test": True})
    r = await client.post("/v1/jobs", json=spec(limits={"image": digest}))
    assert r.status_code == 201, r.text
    await store.delete(blob_key(digest))  # the blob lost (or never fully uploaded)
    r = await client.post("/v1/jobs", json=spec(limits={"image": digest}))
    assert r.status_code == 422 and "blob is missing" in r.text


async def test_a_task_image_must_be_published(client, env) -> None:
    settings, _ = env
    db = Database(settings.db)
    async with db.session() as s:
        s.add(
            Task(
                id="ts-acme:imaged", task_set_id="ts-acme", key="imaged", kind="shell", prompt="p",
                spec={"tests": "assert True", "limits": {"image": MISSING}}, status="valid",
            )
        )  # fmt: skip
    await db.dispose()
    r = await client.post("/v1/jobs", json=spec())
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert MISSING in errors["tasks.taskset"]
