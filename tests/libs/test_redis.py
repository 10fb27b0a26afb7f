"""Redis is Celery's broker and result store; this proves the stack's server works
for both roles (the Celery pipeline itself is tested with the task sets)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

pytestmark = pytest.mark.redis


async def test_redis_round_trip_and_expiry(redis_url: str, unique: str):
    client = aioredis.from_url(redis_url)
    key = f"temper-test:{unique}"
    await client.set(key, b"lease", px=200)
    assert await client.get(key) == b"lease"
    assert 0 < await client.pttl(key) <= 200
    await client.rpush(f"{key}:q", "a", "b")
    assert await client.lpop(f"{key}:q") == b"a"
    await client.delete(key, f"{key}:q")
    await client.aclose()
