from __future__ import annotations

import re
from abc import ABC, abstractmethod

_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")


class NotFound(KeyError):
    """The key does not exist in the store."""


def object_key(tenant: str, job: str, *parts: str) -> str:
    """``tenants/<tenant>/jobs/<job>/<parts...>``; every part is checked so a key can't escape its prefix."""
    for part in (tenant, job, *parts):
        if not _SAFE_PART.match(part):
            raise ValueError(f"invalid object key part {part!r}: use letters, digits, '.', '_', '=', '-'")
    return "/".join(("tenants", tenant, "jobs", job, *parts))


def check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


class ObjectStore(ABC):
    """Async object storage. Implementations must make ``put`` atomic: a reader sees the
    whole old object or the whole new one, never a partial write."""

    @abstractmethod
    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None: ...

    @abstractmethod
    async def get(self, key: str) -> bytes:
        """The object's bytes; raises :class:`NotFound`."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, sorted."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Delete; deleting a missing key is not an error."""

    async def check(self) -> None:
        """Raise if the store cannot be reached (used by /health)."""
        await self.list("__health__/")
