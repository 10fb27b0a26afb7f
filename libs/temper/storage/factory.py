from __future__ import annotations

from temper.settings import Settings, StorageKind
from temper.storage.base import ObjectStore
from temper.storage.local import LocalStore
from temper.storage.s3 import S3Store


def make_store(settings: Settings) -> ObjectStore:
    """The store the settings name: a local directory (embedded) or S3 (distributed)."""
    if settings.storage.kind is StorageKind.s3:
        return S3Store(settings.storage)
    return LocalStore(settings.storage.root)
