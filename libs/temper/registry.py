"""The policy version registry: every published version in object storage, checksummed.

A version lives under a per-job prefix, ``<tenant>/<job>/versions/v<N>/``:

- ``kind = "lora"``: a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``), to be applied on ``base_model``;
- ``kind = "full"``: a Hugging Face model directory (``config.json``, safetensors shards
  and their index, ``generation_config.json``, the tokenizer with its chat template);

plus ``manifest.json`` (written last, so a manifest names only files already there):
job, version, base model, kind, step, and the SHA-256 and size of every file. The
manifest's key is what ``policy.updates`` carries (``checkpoint_key``) and what
``policy_versions.checkpoint_key`` stores.

:func:`fetch_version` downloads a version and checks every file against the manifest;
a missing, truncated or altered file raises :class:`CorruptVersion` naming the file, and
nothing half-written is left at the destination. Trainer-private files (optimizer
state) sit under ``trainer/`` beside the version and are checksummed too, but are not
part of what a server loads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from temper.storage import NotFound, ObjectStore, object_key

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "temper-policy-version-v1"
TRAINER_DIR = "trainer"  # files under this folder are the trainer's, not the server's

Kind = Literal["lora", "full"]


class CorruptVersion(ValueError):
    """A version whose files do not match its manifest (or whose manifest is unreadable)."""


class FileEntry(BaseModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class Manifest(BaseModel):
    format: Literal["temper-policy-version-v1"] = "temper-policy-version-v1"
    job_id: str
    version: int = Field(ge=0)
    kind: Kind
    base_model: str = Field(description="the model the version applies to (lora) or derives from (full)")
    step: int = 0
    files: dict[str, FileEntry] = Field(description="relative path -> checksum, every file of the version")

    def served_files(self) -> list[str]:
        return sorted(p for p in self.files if not p.startswith(TRAINER_DIR + "/"))


def version_prefix(tenant_id: str, job_id: str, version: int) -> str:
    return object_key(tenant_id, job_id, "versions", f"v{version}")


def manifest_key(prefix: str) -> str:
    return prefix.rstrip("/") + "/" + MANIFEST_FILE


def prefix_of(key: str) -> str:
    """The version prefix of a manifest key."""
    if not key.endswith("/" + MANIFEST_FILE):
        raise ValueError(f"{key!r} is not a manifest key (…/{MANIFEST_FILE})")
    return key[: -len(MANIFEST_FILE) - 1]


def is_manifest_key(key: str) -> bool:
    return key.endswith("/" + MANIFEST_FILE)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }


async def publish_version(
    store: ObjectStore,
    prefix: str,
    directory: str | Path,
    *,
    job_id: str,
    version: int,
    kind: Kind,
    base_model: str,
    step: int = 0,
    extra: dict[str, bytes] | None = None,
    uploaded: dict[str, FileEntry] | None = None,
) -> str:
    """Upload every file of ``directory`` (and ``extra``: relative path -> bytes) under
    ``prefix``, then the manifest; returns the manifest's key. ``uploaded`` lists files
    already under ``prefix`` (each rank's shard of a sharded trainer state), named in the
    manifest as they are. Re-publishing the same version overwrites it whole (a trainer
    retrying a failed publish)."""
    files = await asyncio.to_thread(_read_tree, Path(directory))
    files.update(extra or {})
    if kind == "lora" and "adapter_config.json" not in files:
        raise ValueError(f"{directory} is not a PEFT adapter directory (no adapter_config.json)")
    if kind == "full" and "config.json" not in files:
        raise ValueError(f"{directory} is not a model directory (no config.json)")
    manifest = Manifest(
        job_id=job_id,
        version=version,
        kind=kind,
        base_model=base_model,
        step=step,
        files={
            **(uploaded or {}),
            **{name: FileEntry(sha256=sha256(data), size=len(data)) for name, data in files.items()},
        },
    )
    for name, data in files.items():
        await store.put(f"{prefix.rstrip('/')}/{name}", data)
    key = manifest_key(prefix)
    await store.put(key, manifest.model_dump_json(indent=2).encode())
    return key


async def read_manifest(store: ObjectStore, key: str) -> Manifest:
    try:
        raw = await store.get(key)
    except NotFound:
        raise CorruptVersion(f"{key}: no manifest at this key") from None
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise CorruptVersion(f"{key}: not a version manifest: {exc.errors()[0]['msg']}") from None


async def fetch_files(
    store: ObjectStore, key: str, *, trainer: bool = False, names: list[str] | None = None
) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest at ``key`` and its files (the server's; with ``trainer`` also the
    trainer's; or those in ``names``), each checked against its checksum."""
    manifest = await read_manifest(store, key)
    prefix = prefix_of(key)
    if names is None:
        names = sorted(manifest.files) if trainer else manifest.served_files()
    elif unknown := [n for n in names if n not in manifest.files]:
        raise CorruptVersion(f"{key}: the manifest names no file {unknown[0]!r}")
    out: dict[str, bytes] = {}
    for name in names:
        if ".." in Path(name).parts or name.startswith("/"):
            raise CorruptVersion(f"{key}: file name {name!r} leaves the version's folder")
        try:
            data = await store.get(f"{prefix}/{name}")
        except NotFound:
            raise CorruptVersion(
                f"policy version {manifest.version} of job {manifest.job_id} is corrupt: {name} is missing"
            ) from None
        entry = manifest.files[name]
        if len(data) != entry.size or sha256(data) != entry.sha256:
            raise CorruptVersion(
                f"policy version {manifest.version} of job {manifest.job_id} is corrupt: {name} does not "
                f"match its checksum (sha256 {sha256(data)[:12]}…, {len(data)} bytes; manifest says "
                f"{entry.sha256[:12]}…, {entry.size} bytes)"
            )
        out[name] = data
    return manifest, out


async def fetch_version(store: ObjectStore, key: str, dest: str | Path) -> Manifest:
    """Download and verify the version at manifest ``key`` into the directory ``dest``
    (replaced atomically; the manifest is copied too). Raises :class:`CorruptVersion`."""
    manifest, files = await fetch_files(store, key)
    dest = Path(dest)

    def write() -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        try:
            for name, data in files.items():
                p = tmp / name
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    await asyncio.to_thread(write)
    return manifest


def verify_directory(directory: str | Path) -> Manifest:
    """Check a fetched version directory (e.g. one a sidecar synced) against its manifest."""
    d = Path(directory)
    try:
        manifest = Manifest.model_validate(json.loads((d / MANIFEST_FILE).read_text()))
    except (OSError, ValueError) as exc:
        raise CorruptVersion(f"{d}: no readable {MANIFEST_FILE}: {exc}") from None
    for name in manifest.served_files():
        p = d / name
        if not p.is_file():
            raise CorruptVersion(f"{d}: {name} is missing")
        data = p.read_bytes()
        if sha256(data) != manifest.files[name].sha256:
            raise CorruptVersion(f"{d}: {name} does not match its checksum")
    return manifest


# --- versions as archives (downloads) -------------------------------------------------------

BASE_DIR = "base"  # where a LoRA version's base model goes in an archive that carries it


def tar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file (mode 0644, owner 0, time 0: the same
    bytes for the same version)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, 0, tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def tar_member(name: str, data: bytes) -> list[bytes]:
    """One file of an uncompressed tar stream: header, data, padding to 512 bytes."""
    return [tar_header(name, len(data)), data, b"\0" * (-len(data) % 512)]


TAR_END = b"\0" * 1024  # two zero blocks end a tar archive


async def version_archive(
    store: ObjectStore, key: str, *, base: dict[str, bytes] | None = None
) -> AsyncIterator[bytes]:
    """The version at manifest ``key`` as an uncompressed tar stream: ``manifest.json``
    first, then every served file, each checked against its checksum as it is read (a
    mismatch raises :class:`CorruptVersion` and ends the stream short, which the reader's
    own check of the manifest catches). ``base`` (relative path -> bytes) adds a base model
    under ``base/``. The trainer's private files are not part of it."""
    manifest = await read_manifest(store, key)
    for chunk in tar_member(MANIFEST_FILE, manifest.model_dump_json(indent=2).encode()):
        yield chunk
    for name in manifest.served_files():
        _, files = await fetch_files(store, key, names=[name])
        for chunk in tar_member(name, files[name]):
            yield chunk
    for name, data in sorted((base or {}).items()):
        for chunk in tar_member(f"{BASE_DIR}/{name}", data):
            yield chunk
    yield TAR_END


def extract_archive(archive: str | Path, dest: str | Path) -> Manifest:
    """Unpack a version archive into ``dest`` (which must not exist or be empty) and check
    it against its manifest. Only regular files inside ``dest`` are written: a member that
    is a link, a device or a path leaving ``dest`` raises :class:`CorruptVersion`."""
    import tarfile

    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if not member.isreg() or member.name.startswith("/") or ".." in parts or not parts:
                    raise CorruptVersion(
                        f"{archive}: member {member.name!r} is not a file inside the version"
                    )
                target = dest / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with source, target.open("wb") as out:
                    shutil.copyfileobj(source, out)
    except tarfile.TarError as exc:
        raise CorruptVersion(f"{archive}: not a complete version archive ({exc})") from None
    return verify_directory(dest)
