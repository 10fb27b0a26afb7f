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
import shutil
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


async def fetch_model(store: ObjectStore | None, ref: str, cache_dir: str | Path) -> Path:
    """A model a job names (``policy.model``/``policy.init``) as a local directory: a local
    model directory as it is, else the object-store prefix of one (``config.json``,
    safetensors, tokenizer: the files directly under it) fetched once into ``cache_dir``."""
    local = Path(ref)
    if await asyncio.to_thread((local / "config.json").is_file):
        return local
    if store is None:
        raise NotFound(f"{ref}: not a local model directory, and no object store to fetch it from")
    prefix = ref.rstrip("/") + "/"
    dest = Path(cache_dir) / "models" / check_key(ref.rstrip("/"))
    if await asyncio.to_thread((dest / "config.json").is_file):
        return dest
    keys = [k for k in await store.list(prefix) if "/" not in k[len(prefix) :]]
    if prefix + "config.json" not in keys:
        raise NotFound(f"{ref}: no model directory there (no config.json)")
    files = {k[len(prefix) :]: await store.get(k) for k in keys}

    def write() -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            os.replace(tmp, dest)  # whole, or not at all
        except OSError:  # fetched meanwhile by another backend
            shutil.rmtree(tmp, ignore_errors=True)

    await asyncio.to_thread(write)
    return dest
