"""What a job was made from, recorded when it is submitted (``jobs.provenance``): the seeds
its spec names, a digest of its resolved spec, the Temper version and git commit of the
process that accepted it, a digest of its initial model and of its task set's content. The
job's REST detail, ``temper show`` and its tracking runs show it; ``temper rerun`` submits the
same resolved spec again (docs/api.md, "Reproducibility").

Digests are SHA-256, hex:

- **a file tree** (a model directory, an object-store prefix, a registry version):
  ``sha256`` of the canonical JSON ``{"relative/path": "<sha256 of the file>", ...}`` (keys
  sorted, no spaces). A registry version's manifest already holds each file's checksum, so
  its digest needs no download, and it equals the digest of the directory it came from (the
  manifest and the trainer's ``trainer/`` files left out);
- **a task set**: ``sha256`` of its tasks as JSON lines, one per task in the order of their
  ids, each ``{"id", "kind", "prompt", "spec", "metadata"}`` canonical as above;
- **the spec**: ``sha256`` of the stored spec's canonical JSON.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

import temper
from temper.clock import utcnow
from temper.db import Task, TaskSet
from temper.jobspec import JobSpec
from temper.registry import MANIFEST_FILE, TRAINER_DIR, CorruptVersion, read_manifest
from temper.storage import NotFound, ObjectStore

FORMAT = 1
CONFIG_FILE = "config.json"
CHUNK = 1 << 20


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def tree_digest(files: dict[str, str]) -> str:
    """The digest of a file tree given each file's SHA-256 (relative path -> hex)."""
    return digest(dict(sorted(files.items())))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=64)
def _directory_files(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> dict[str, str]:
    # keyed by every file's size and mtime too: a directory rewritten in place is hashed again
    root = Path(directory)
    return {rel: _file_sha256(root / rel) for rel, _, _ in stamp}


def directory_files(directory: Path) -> dict[str, str]:
    """Each file's SHA-256 under ``directory`` (relative POSIX paths; a registry manifest and
    the trainer's ``trainer/`` files are not the model's)."""
    stamp = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST_FILE or rel.startswith(TRAINER_DIR + "/"):
            continue
        st = path.stat()
        stamp.append((rel, st.st_size, st.st_mtime_ns))
    return _directory_files(str(directory.resolve()), tuple(stamp))


# --- the source: version and commit ---------------------------------------------------------------


@lru_cache(maxsize=1)
def source() -> dict[str, Any]:
    """Temper's version, and the git commit of the checkout this code runs from: ``commit``
    is None (with ``commit_unknown`` saying why) when it runs from an installed package or an
    image, which carry no ``.git``. ``dirty``: tracked files differ from the commit. Read once
    per process."""
    out: dict[str, Any] = {"version": temper.__version__, "commit": None, "dirty": None}
    root = Path(temper.__file__).resolve().parents[2]  # libs/temper/__init__.py -> the checkout
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )  # fmt: skip
        if commit.returncode != 0 or not commit.stdout.strip():
            out["commit_unknown"] = "not a git checkout (an installed package or an image carries no .git)"
            return out
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["commit_unknown"] = f"git could not be run here: {exc.__class__.__name__}"
        return out
    out["commit"] = commit.stdout.strip()
    out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return out


# --- the model ------------------------------------------------------------------------------------


def local_dir(ref: str) -> Path | None:
    """``ref`` as a directory on this machine, or None (a model name, a key, a path too long)."""
    try:
        path = Path(ref)
        return path if len(ref) < 4096 and path.is_dir() else None
    except (OSError, ValueError):
        return None


async def model_provenance(spec: JobSpec, store: ObjectStore | None) -> dict[str, Any]:
    """The job's initial weights, resolved as the trainer resolves them (``policy.init``, else
    ``policy.model`` when it is a model directory, else the trainer's preset), and their
    digest where the files can be seen from here."""
    policy = spec.policy
    model_dir = local_dir(policy.model)
    ref = policy.init or (
        policy.model if model_dir is not None and (model_dir / CONFIG_FILE).is_file() else None
    )
    out: dict[str, Any] = {"policy_model": policy.model, "init": ref, "source": None, "sha256": None}
    if ref is None:
        out["source"] = "preset"
        out["note"] = (
            "no initial weights named: the trainer builds its TEMPER_TRAINER__PRESET model from "
            "TEMPER_TRAINER__SEED, settings of the trainer's own that this process cannot see"
        )
        return out
    directory = local_dir(ref)
    if directory is not None:
        files = await asyncio.to_thread(directory_files, directory)
        out.update(source="directory", sha256=tree_digest(files), files=len(files))
        return out
    if store is None:
        out.update(source="object store", note="no object store here to read it from")
        return out
    try:
        how, objects = await _object_files(store, ref)
    except (NotFound, CorruptVersion) as exc:
        out.update(source="object store", note=f"not readable: {str(exc)[:200]}")
        return out
    out.update(source=how, sha256=tree_digest(objects), files=len(objects))
    return out


async def _object_files(store: ObjectStore, ref: str) -> tuple[str, dict[str, str]]:
    """(how, relative path -> SHA-256) of an object-store reference: a registry version (its
    manifest key or prefix: the manifest's checksums), a prefix of objects, or one
    ``.safetensors`` object (as ``model.safetensors``)."""
    if ref.endswith(".safetensors"):
        return "object", {"model.safetensors": hashlib.sha256(await store.get(ref)).hexdigest()}
    prefix = ref[: -len(MANIFEST_FILE) - 1] if ref.endswith("/" + MANIFEST_FILE) else ref.rstrip("/")
    keys = await store.list(prefix + "/")
    if f"{prefix}/{MANIFEST_FILE}" in keys:
        manifest = await read_manifest(store, f"{prefix}/{MANIFEST_FILE}")
        return "registry version", {name: manifest.files[name].sha256 for name in manifest.served_files()}
    direct = [k for k in keys if "/" not in k[len(prefix) + 1 :]]
    if not direct:
        raise NotFound(f"no objects under {prefix}/")
    return "object prefix", {
        k[len(prefix) + 1 :]: hashlib.sha256(await store.get(k)).hexdigest() for k in direct
    }


# --- the task set ---------------------------------------------------------------------------------


def tasks_digest(tasks: Iterable[dict[str, Any]]) -> str:
    """The digest of tasks given as ``{"id", "kind", "prompt", "spec", "metadata"}`` mappings."""
    lines = sorted((t["id"], canonical(t)) for t in tasks)
    return hashlib.sha256(b"\n".join(line for _, line in lines)).hexdigest()


async def taskset_provenance(session: AsyncSession, taskset_id: str) -> dict[str, Any]:
    taskset = await session.get(TaskSet, taskset_id)
    rows = (
        await session.execute(
            select(Task.key, Task.kind, Task.prompt, Task.spec, Task.meta).where(
                Task.task_set_id == taskset_id
            )
        )
    ).all()
    tasks = [
        {"id": key, "kind": kind, "prompt": prompt, "spec": spec or {}, "metadata": meta or {}}
        for key, kind, prompt, spec, meta in rows
    ]
    return {
        "id": taskset_id,
        "name": taskset.name if taskset is not None else None,
        "tasks": len(tasks),
        "sha256": tasks_digest(tasks),
    }


# --- the record -----------------------------------------------------------------------------------


def seeds(spec: JobSpec) -> dict[str, int]:
    """Every seed the spec names. Task sampling draws from ``random.Random`` seeded with
    ``tasks.seed``, the job's id, the iteration and the group's number: a rerun (a new id)
    draws its own tasks."""
    return {"tasks.seed": spec.tasks.seed}


async def record(
    session: AsyncSession,
    spec: JobSpec,
    stored_spec: dict[str, Any],
    *,
    store: ObjectStore | None,
    rerun_of: str | None = None,
) -> dict[str, Any]:
    """The provenance of a job about to be created from ``spec`` (stored as ``stored_spec``)."""
    out: dict[str, Any] = {
        "format": FORMAT,
        "recorded_at": utcnow().isoformat(),
        "seeds": seeds(spec),
        "spec_sha256": digest(stored_spec),
        "temper": source(),
        "model": await model_provenance(spec, store),
        "taskset": await taskset_provenance(session, spec.tasks.taskset),
    }
    if rerun_of is not None:
        out["rerun_of"] = rerun_of
    return out
