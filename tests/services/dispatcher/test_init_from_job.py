"""``policy.init: job:<job>@v<N>`` at the door (``init_errors``): what the serve test
does not reach: a LoRA version, another tokenizer, and the pinned prefix."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.dispatcher.api.validation import init_errors
from temper import registry
from temper.db import Database, Job, PolicyVersion, Tenant
from temper.db.migrate import upgrade
from temper.jobspec import parse_spec
from temper.policy import byte_tokenizer
from temper.settings import DatabaseSettings
from temper.storage.local import LocalStore


@pytest.fixture
async def door(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/t.db"
    await asyncio.to_thread(upgrade, url)
    db = Database(DatabaseSettings(url=url))
    store = LocalStore(tmp_path / "objects")
    async with db.session() as s:
        s.add(Tenant(id="acme", name="Acme"))
    for job_id, kind in (("job-full", "full"), ("job-lora", "lora")):
        version = tmp_path / job_id
        version.mkdir()
        if kind == "full":
            (version / "config.json").write_text("{}")
            (version / "tokenizer.json").write_text('{"a": 1}')
        else:
            (version / "adapter_config.json").write_text("{}")
        prefix = registry.version_prefix("acme", job_id, 1)
        key = await registry.publish_version(
            store, prefix, version, job_id=job_id, version=1, kind=kind, base_model="m"
        )
        async with db.session() as s:
            s.add(Job(id=job_id, tenant_id="acme", name=job_id, handle=job_id.removeprefix("job-"),
                      spec={"policy": {"model": "m"}}, state="completed"))  # fmt: skip
        async with db.session() as s:
            s.add(PolicyVersion(job_id=job_id, version=1, checkpoint_key=key, step=3, metrics={}))
    yield db, store
    await db.dispose()


def rl_spec(init: str, model: str = "m"):
    return parse_spec({"name": "rl", "policy": {"model": model, "init": init}, "tasks": {"taskset": "ts"}})


async def test_a_full_version_is_pinned_to_its_prefix(door):
    db, store = door
    spec = rl_spec("job:full@latest")  # by handle, the latest
    async with db.session() as s:
        assert await init_errors(s, spec=spec, tenant_id="acme", store=store) == []
    assert spec.policy.init == "tenants/acme/jobs/job-full/versions/v1"


async def test_a_lora_version_and_another_tenant_are_refused(door):
    db, store = door
    async with db.session() as s:
        [(field, message)] = await init_errors(
            s, spec=rl_spec("job:job-lora@v1"), tenant_id="acme", store=store
        )
        assert field == "policy.init" and "is a LoRA adapter" in message
        [(_, message)] = await init_errors(s, spec=rl_spec("job:job-full@v1"), tenant_id="other", store=store)
        assert "no job of yours" in message


async def test_a_model_directory_with_another_tokenizer_is_refused(door, tmp_path):
    db, store = door
    model = tmp_path / "model"
    byte_tokenizer().save(model)
    (model / "config.json").write_text(json.dumps({}))
    async with db.session() as s:
        await s.execute(Job.__table__.update().values(spec={"policy": {"model": str(model)}}))
    async with db.session() as s:
        [(_, message)] = await init_errors(
            s, spec=rl_spec("job:job-full@v1", model=str(model)), tenant_id="acme", store=store
        )
    assert "trained with another tokenizer" in message
