"""Fetch a checkpoint named by an object-store key into a local file.

A key names either a ``.safetensors`` file or a model directory prefix whose
``model.safetensors`` holds the weights (what ``temper.policy.save_checkpoint`` writes).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from temper.storage import NotFound, ObjectStore


def weights_key(key: str) -> str:
    return key if key.endswith(".safetensors") else key.rstrip("/") + "/model.safetensors"


async def fetch_checkpoint(store: ObjectStore, key: str, cache_dir: str | Path, version: int) -> Path:
    """Download the weights of ``key`` to ``cache_dir/v<version>.safetensors`` (atomic rename)."""
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
