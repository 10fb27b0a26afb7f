from __future__ import annotations

import pytest

from temper.storage import LocalStore, NotFound, ObjectStore, S3Store, object_key


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
async def store(request, tmp_path, unique):
    if request.param == "local":
        yield LocalStore(tmp_path / "objects"), ""
        return
    s3 = S3Store(request.getfixturevalue("s3_settings"))
    await s3.ensure_bucket()
    prefix = f"test-{unique}/"
    yield s3, prefix
    for key in await s3.list(prefix):
        await s3.delete(key)


async def test_put_get_list_delete(store: tuple[ObjectStore, str]):
    s, prefix = store
    await s.put(f"{prefix}a/one.json", b'{"n": 1}', content_type="application/json")
    await s.put(f"{prefix}a/two.bin", bytes(range(256)) * 1000)
    await s.put(f"{prefix}b/three", b"3")
    assert await s.get(f"{prefix}a/one.json") == b'{"n": 1}'
    assert await s.get(f"{prefix}a/two.bin") == bytes(range(256)) * 1000
    assert await s.list(f"{prefix}a/") == [f"{prefix}a/one.json", f"{prefix}a/two.bin"]
    assert await s.exists(f"{prefix}b/three")
    await s.put(f"{prefix}b/three", b"overwritten")
    assert await s.get(f"{prefix}b/three") == b"overwritten"
    await s.delete(f"{prefix}b/three")
    assert not await s.exists(f"{prefix}b/three")
    with pytest.raises(NotFound):
        await s.get(f"{prefix}b/three")
    await s.delete(f"{prefix}b/three")  # deleting twice is fine


async def test_keys_cannot_escape_their_prefix(store: tuple[ObjectStore, str]):
    s, _ = store
    for bad in ("../etc/passwd", "/abs", "a//b", "a/./b"):
        with pytest.raises(ValueError):
            await s.put(bad, b"x")


def test_object_keys_are_namespaced_per_tenant_and_job():
    assert (
        object_key("acme", "job-1", "trajectories", "ep-1.json")
        == "tenants/acme/jobs/job-1/trajectories/ep-1.json"
    )
    with pytest.raises(ValueError):
        object_key("acme", "../other", "x")


async def test_an_unreachable_s3_server_fails_the_check():
    from pydantic import SecretStr

    from temper.settings import StorageSettings

    s3 = S3Store(StorageSettings(endpoint="127.0.0.1:1", secret_key=SecretStr("x" * 8)))
    with pytest.raises(Exception):  # noqa: B017 - urllib3 raises its own connection errors
        await s3.check()
