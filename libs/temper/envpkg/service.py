"""Store and find tenant packages in object storage (no database table: the index is the
keys). A version is immutable: the same archive uploaded again is accepted as it is,
a different one under a taken version is refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from temper.envpkg.archive import Package, read_package
from temper.jobspec import PACKAGE_KIND, JobSpec, SpecError
from temper.storage import NotFound, ObjectStore
from temper.storage.base import check_key


class VersionTaken(ValueError):
    pass


def package_prefix(tenant_id: str, name: str | None = None) -> str:
    return check_key("/".join(["tenants", tenant_id, "environments", *([name] if name else [])])) + "/"


def archive_key(tenant_id: str, name: str, version: str) -> str:
    return check_key(f"{package_prefix(tenant_id, name)}{version}/package.tar.gz")


def meta_key(tenant_id: str, name: str, version: str) -> str:
    return check_key(f"{package_prefix(tenant_id, name)}{version}/package.json")


def content_digest(pkg: Package) -> str:
    """A digest of what the package holds (not of the archive's bytes: gzip stamps a time)."""
    h = hashlib.sha256(pkg.manifest.model_dump_json().encode())
    for part, files in (("public", pkg.public), ("hidden", pkg.hidden)):
        for path in sorted(files):
            h.update(f"\0{part}\0{path}\0".encode() + files[path].encode())
    return h.hexdigest()


async def upload(store: ObjectStore, *, tenant_id: str, data: bytes) -> tuple[dict[str, Any], bool]:
    """Check and store the package in ``data``; returns (its description, created). Raises
    :class:`temper.envpkg.archive.PackageError`, :class:`temper.envpkg.models.ManifestError`
    or :class:`VersionTaken`."""
    pkg = read_package(data)
    m = pkg.manifest
    digest = content_digest(pkg)
    existing = await get(store, tenant_id=tenant_id, name=m.name, version=m.version)
    if existing is not None:
        if existing["sha256"] != digest:
            raise VersionTaken(
                f"{m.name} {m.version} already exists with other content; versions are immutable, give a new version"
            )
        return existing, False
    key = archive_key(tenant_id, m.name, m.version)
    meta = {
        "name": m.name, "version": m.version, "description": m.description, "sha256": digest,
        "archive_key": key, "uploaded_at": datetime.now(UTC).isoformat(),
        "tools": [t.function.name for t in m.tools], "rubric": m.rubric,
        "public_files": sorted(pkg.public), "hidden_files": len(pkg.hidden),
        "manifest": m.model_dump(mode="json"),
    }  # fmt: skip
    await store.put(key, data, "application/gzip")
    await store.put(meta_key(tenant_id, m.name, m.version), json.dumps(meta).encode(), "application/json")
    return meta, True


async def get(store: ObjectStore, *, tenant_id: str, name: str, version: str) -> dict[str, Any] | None:
    """The description of the tenant's package, or None (another tenant's is None too)."""
    try:
        key = meta_key(tenant_id, name, version)
    except ValueError:
        return None
    try:
        return json.loads(await store.get(key))  # type: ignore[no-any-return]
    except NotFound:
        return None


async def list_packages(store: ObjectStore, *, tenant_id: str) -> list[dict[str, Any]]:
    keys = [k for k in await store.list(package_prefix(tenant_id)) if k.endswith("/package.json")]
    metas = await asyncio.gather(*(store.get(k) for k in sorted(keys)))
    return [json.loads(m) for m in metas]


# What the package decides; a job that names a package may not set them itself.
PACKAGE_DECIDES = ("max_turns", "action_format", "tools", "limits", "system_prompt")


async def pin(store: ObjectStore | None, *, tenant_id: str, spec: JobSpec) -> None:
    """Fill a job spec that names a package (``environment.kind: package``) from the
    tenant's stored package: its turns, action format, tools, limits and rubric (as the
    job's ``rewards``), and ``environment.package`` (:meth:`Manifest.package_spec`).
    :class:`SpecError` when the tenant has no such package or the spec sets what the
    package decides."""
    env = spec.environment
    if env.kind != PACKAGE_KIND:
        return
    errors = [
        (f"environment.{f}", "set by the package's environment.yaml; remove it from the job")
        for f in PACKAGE_DECIDES
        if f in env.model_fields_set
    ]
    if "rewards" in spec.model_fields_set:
        errors.append(("rewards", "a package job is scored by the package's rubric; remove rewards"))
    assert env.name is not None and env.version is not None
    if store is None:
        raise SpecError([("environment.kind", "packages live in object storage, and none is configured")])
    meta = await get(store, tenant_id=tenant_id, name=env.name, version=env.version)
    if meta is None:
        mine = sorted(f"{m['name']} {m['version']}" for m in await list_packages(store, tenant_id=tenant_id))
        errors.append(
            ("environment.name", f"no environment package {env.name!r} version {env.version!r} of yours "
             f"(yours: {', '.join(mine[:20]) or 'none'})")
        )  # fmt: skip
    if errors:
        raise SpecError(errors)
    assert meta is not None
    pkg = read_package(await store.get(meta["archive_key"]))
    m = pkg.manifest
    env.max_turns, env.action_format, env.limits = m.max_turns, m.action_format, m.agent_limits()
    env.tools, env.system_prompt = list(m.tools), None
    env.package = m.package_spec(meta["archive_key"], pkg.public)
    spec.rewards = dict(m.rubric)
