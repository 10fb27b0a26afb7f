from __future__ import annotations

import asyncio
import io

from minio import Minio
from minio.error import S3Error

from temper.settings import StorageSettings
from temper.storage.base import NotFound, ObjectStore, check_key


class S3Store(ObjectStore):
    """Any S3-compatible server through the ``minio`` client. The client is blocking,
    so each call runs in a worker thread."""

    def __init__(self, settings: StorageSettings) -> None:
        self.bucket = settings.bucket
        self.client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key.get_secret_value(),
            secure=settings.secure,
            region=settings.region,
        )

    async def ensure_bucket(self) -> None:
        def ensure() -> None:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)

        await asyncio.to_thread(ensure)

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        check_key(key)
        await asyncio.to_thread(
            self.client.put_object, self.bucket, key, io.BytesIO(data), len(data), content_type=content_type
        )

    async def get(self, key: str) -> bytes:
        check_key(key)

        def read() -> bytes:
            try:
                response = self.client.get_object(self.bucket, key)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject"):
                    raise NotFound(key) from None
                raise
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return await asyncio.to_thread(read)

    async def exists(self, key: str) -> bool:
        check_key(key)

        def stat() -> bool:
            try:
                self.client.stat_object(self.bucket, key)
                return True
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                    return False
                raise

        return await asyncio.to_thread(stat)

    async def list(self, prefix: str) -> list[str]:
        def names() -> list[str]:
            objects = self.client.list_objects(self.bucket, prefix=prefix, recursive=True)
            return sorted(o.object_name for o in objects if o.object_name)

        return await asyncio.to_thread(names)

    async def delete(self, key: str) -> None:
        check_key(key)
        await asyncio.to_thread(self.client.remove_object, self.bucket, key)
