"""What the components that grade with a model (``reward_model``, ``judge``) need from the
process that scores: the object store their models are fetched from, where fetched models
are kept, the device a reward model runs on, and the way a judge's question reaches the
inference gateway. One :class:`Graders` per scorer process, handed to every score through
the :class:`temper.rewards.ScoreContext`."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temper import registry
from temper.events import InferenceRequest, InferenceResult
from temper.provenance import directory_files, local_dir, tree_digest
from temper.storage import NotFound, ObjectStore

# (request, timeout in seconds) -> the gateway's result; raises TimeoutError past the timeout
Ask = Callable[[InferenceRequest, float], Awaitable[InferenceResult]]


class ModelNotFound(LookupError):
    """A grader's model cannot be found or read; the message says where it looked."""


@dataclass
class Graders:
    store: ObjectStore | None = None
    device: str = "auto"  # auto (CUDA where visible), cpu or cuda
    cache_dir: Path | None = None  # where models from object storage are fetched to
    max_batch: int = 16  # transcripts one reward-model forward scores at most
    ask: Ask | None = None  # the judge's way to the inference gateway
    _fetching: dict[str, asyncio.Lock] = field(default_factory=dict)

    def cache(self) -> Path:
        if self.cache_dir is None:
            self.cache_dir = Path(tempfile.mkdtemp(prefix="temper-graders-"))
        return self.cache_dir

    async def model_dir(self, ref: str) -> tuple[Path, str]:
        """A model a grader names, as a local directory and its digest (SHA-256 over its
        served files' checksums, :func:`temper.provenance.tree_digest`): a local model
        directory as it is, or a published version in object storage (its prefix or
        manifest key; ``job:<job>@v<N>`` references are pinned to one at submission),
        fetched and checked once."""
        directory = local_dir(ref)
        if directory is not None:
            if not (directory / "config.json").is_file():
                raise ModelNotFound(f"{ref} is a directory without config.json, not a model directory")
            files = await asyncio.to_thread(directory_files, directory)
            return directory, tree_digest(files)
        if ref.startswith("job:"):
            raise ModelNotFound(
                f"{ref}: a job reference is resolved when the job is submitted (POST /v1/jobs)"
            )
        if self.store is None:
            raise ModelNotFound(f"{ref}: not a local model directory, and no object store to fetch it from")
        key = ref if registry.is_manifest_key(ref) else registry.manifest_key(ref)
        lock = self._fetching.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                manifest = await registry.read_manifest(self.store, key)
            except registry.CorruptVersion as exc:
                raise ModelNotFound(f"{ref}: not a published version ({exc})") from None
            digest = tree_digest({name: manifest.files[name].sha256 for name in manifest.served_files()})
            dest = self.cache() / "models" / digest
            if not (dest / "config.json").is_file():
                try:
                    await registry.fetch_version(self.store, key, dest)
                except (registry.CorruptVersion, NotFound) as exc:
                    raise ModelNotFound(f"{ref}: {exc}") from None
            return dest, digest


def text_digest(*parts: Any) -> str:
    """SHA-256 of the parts' text, separated: a cache key."""
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()
