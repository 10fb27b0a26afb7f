"""Fetch a checkpoint named by an object-store key to local disk.

A key names a registry version's manifest (``…/versions/v<N>/manifest.json``, what the
trainer publishes: fetched whole into ``<cache_dir>/<version prefix>/`` and checked
against the manifest's checksums, :class:`temper.registry.CorruptVersion` if it does not
match), a ``.safetensors`` file, or a model directory prefix whose ``model.safetensors``
holds the weights.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from temper import registry
from temper.storage import NotFound, ObjectStore
from temper.storage.base import check_key


def weights_key(key: str) -> str:
    return key if key.endswith(".safetensors") else key.rstrip("/") + "/model.safetensors"


async def fetch_checkpoint(store: ObjectStore, key: str, cache_dir: str | Path, version: int) -> Path:
    """Download ``key``: a version directory (see the module docstring), or the weights
    alone to ``cache_dir/v<version>.safetensors`` (atomic rename)."""
    if registry.is_manifest_key(key):
        dest = Path(cache_dir) / check_key(registry.prefix_of(key))
        if dest.is_dir():
            try:  # fetched before (another backend, a restart): reuse it if it is intact
                if (await asyncio.to_thread(registry.verify_directory, dest)).version == version:
                    return dest
            except registry.CorruptVersion:
                pass
        await registry.fetch_version(store, key, dest)
        return dest
    wkey = weights_key(key)
    try:
        data = await store.get(wkey)
    except NotFound:
        if wkey == key:
            raise
        data = await store.get(key)  # a file without the .safetensors suffix
    out = Path(cache_dir) / f"v{version}.safetensors"

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, out)

    await asyncio.to_thread(write)
    return out
