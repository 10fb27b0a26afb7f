from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from temper.storage.base import NotFound, ObjectStore, check_key


class LocalStore(ObjectStore):
    """A directory as an object store (embedded mode). Writes go to a temporary file
    and are renamed into place, so readers never see half an object."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        await asyncio.to_thread(self._put_sync, self._path(key), data)

    @staticmethod
    def _put_sync(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise NotFound(key) from None

    async def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    async def list(self, prefix: str) -> list[str]:
        def walk() -> list[str]:
            keys = []
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    if name.startswith(".tmp-"):
                        continue
                    key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                    if key.startswith(prefix):
                        keys.append(key)
            return sorted(keys)

        return await asyncio.to_thread(walk)

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
