"""Smoke check of the local stack from the project's venv.

    . .stack/env && .venv/bin/python scripts/stack/smoke.py [postgres redis kafka s3]

Postgres: a query as the application role (asyncpg); Redis: PING/SET/GET;
Kafka: create a topic, produce one message, consume it in a consumer group
with aiokafka; S3: put/get/delete an object with the minio client.
Exits non-zero naming the first server that fails.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
import sys
import time
import uuid


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        sys.exit(f"{name} is not set; source .stack/env first")
    return value


async def check_postgres() -> str:
    import asyncpg

    url = _env("TEMPER_DB__URL").replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(url, timeout=10)
    try:
        version = await conn.fetchval("SHOW server_version")
        can_create = await conn.fetchval("SELECT rolcreatedb FROM pg_roles WHERE rolname = current_user")
        assert can_create, "role cannot CREATE DATABASE"
    finally:
        await conn.close()
    return f"server_version {version}, CREATEDB ok"


async def check_redis() -> str:
    url = _env("TEMPER_REDIS__URL")
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        key = f"smoke-{uuid.uuid4().hex}"
        s.sendall(f"PING\r\nSET {key} v EX 10\r\nGET {key}\r\n".encode())
        data = b""
        while data.count(b"\r\n") < 4:
            data += s.recv(4096)
    assert data.startswith(b"+PONG\r\n+OK\r\n$1\r\nv\r\n"), data
    return "PING/SET/GET ok"


async def check_kafka() -> str:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    bootstrap = _env("TEMPER_BUS__BOOTSTRAP")
    topic = f"smoke-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
        await producer.start()
        try:
            meta = await producer.send_and_wait(topic, b"hello", key=b"episode-1")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=f"{topic}-group",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        t0 = time.monotonic()
        await consumer.start()
        try:
            msg = await asyncio.wait_for(consumer.getone(), timeout=30)
            await consumer.commit()
        finally:
            await consumer.stop()
        assert msg.value == b"hello" and msg.key == b"episode-1", msg
        waited = time.monotonic() - t0
    finally:
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()
    return f"produced to partition {meta.partition}, consumed in group and committed ({waited:.1f}s)"


async def check_s3() -> str:
    from minio import Minio

    client = Minio(
        _env("TEMPER_STORAGE__ENDPOINT"),
        access_key=_env("TEMPER_STORAGE__ACCESS_KEY"),
        secret_key=_env("TEMPER_STORAGE__SECRET_KEY"),
        secure=False,
    )
    bucket = _env("TEMPER_STORAGE__BUCKET")
    assert client.bucket_exists(bucket), f"bucket {bucket} missing"
    key = f"smoke/{uuid.uuid4().hex}"
    body = b"temper smoke object"
    client.put_object(bucket, key, io.BytesIO(body), len(body))
    resp = client.get_object(bucket, key)
    try:
        got = resp.read()
    finally:
        resp.close()
        resp.release_conn()
    client.remove_object(bucket, key)
    assert got == body, got
    return f"put/get/delete {key} in bucket {bucket} ok"


CHECKS = {"postgres": check_postgres, "redis": check_redis, "kafka": check_kafka, "s3": check_s3}


async def main(names: list[str]) -> int:
    for name in names or list(CHECKS):
        t0 = time.monotonic()
        try:
            detail = await CHECKS[name]()
        except Exception as exc:  # report and fail on the first broken server
            print(f"{name}: FAILED: {exc!r}")
            return 1
        print(f"{name}: ok in {time.monotonic() - t0:.2f}s: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
