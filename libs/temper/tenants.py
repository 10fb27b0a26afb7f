"""Tenants and their API keys.

A key is ``tmp_`` followed by 40 random URL-safe characters. Only its sha256 is stored
(with the first characters, for display); the key itself is shown once, when it is made.
The dispatcher's API, the ``temper admin`` CLI and the embedded runner share these
functions; each takes the caller's session and commits nothing itself.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from temper.clock import utcnow
from temper.db import ApiKey, Tenant

KEY_PREFIX = "tmp_"
DISPLAY_CHARS = 12
_TENANT_ID = re.compile(r"[^a-z0-9-]+")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)


def tenant_id_for(name: str) -> str:
    """A readable id from a name: ``"Team One"`` -> ``team-one``."""
    slug = _TENANT_ID.sub("-", name.lower()).strip("-")[:48]
    return slug or "tenant"


@dataclass(frozen=True)
class IssuedKey:
    """A key as it is handed out: the only moment its value is known."""

    id: int
    tenant_id: str
    prefix: str
    key: str
    admin: bool


async def issue_key(
    session: AsyncSession, *, tenant_id: str, name: str = "", admin: bool = False, key: str | None = None
) -> IssuedKey:
    """Store a new key for ``tenant_id`` (a given ``key`` value, or a random one)."""
    value = key or new_key()
    row = ApiKey(
        tenant_id=tenant_id, name=name, prefix=value[:DISPLAY_CHARS], key_hash=hash_key(value), admin=admin
    )
    session.add(row)
    await session.flush()
    return IssuedKey(id=row.id, tenant_id=tenant_id, prefix=row.prefix, key=value, admin=admin)


class TenantExists(ValueError):
    pass


async def create_tenant(
    session: AsyncSession,
    *,
    name: str,
    tenant_id: str | None = None,
    max_concurrent_episodes: int = 64,
    admin: bool = False,
    weight: float = 1.0,
    quota_sandbox_cpu_s: float | None = None,
    quota_inference_tokens: int | None = None,
    quota_sandbox_memory_gb_s: float | None = None,
    quota_trainer_s: float | None = None,
) -> tuple[Tenant, IssuedKey]:
    """A new tenant and its first key. Raises :class:`TenantExists` if the id is taken."""
    tid = tenant_id or tenant_id_for(name)
    if await session.get(Tenant, tid) is not None:
        raise TenantExists(f"tenant {tid!r} already exists")
    tenant = Tenant(
        id=tid,
        name=name,
        max_concurrent_episodes=max_concurrent_episodes,
        weight=weight,
        quota_sandbox_cpu_s=quota_sandbox_cpu_s,
        quota_inference_tokens=quota_inference_tokens,
        quota_sandbox_memory_gb_s=quota_sandbox_memory_gb_s,
        quota_trainer_s=quota_trainer_s,
    )
    session.add(tenant)
    await session.flush()
    issued = await issue_key(session, tenant_id=tid, name="initial", admin=admin)
    return tenant, issued


@dataclass(frozen=True)
class Caller:
    """Who is calling: the tenant and the key it used."""

    tenant: Tenant
    key_id: int
    admin: bool


async def authenticate(session: AsyncSession, key: str) -> Caller | None:
    """The caller a key belongs to, or None for an unknown or revoked key."""
    if not key:
        return None
    row = (
        await session.execute(
            select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
        )
    ).scalar_one_or_none()
    if row is None:
        return None
    tenant = await session.get(Tenant, row.tenant_id)
    if tenant is None:
        return None
    return Caller(tenant=tenant, key_id=row.id, admin=row.admin)


async def revoke_key(session: AsyncSession, *, tenant_id: str, key_id: int) -> bool:
    row = await session.get(ApiKey, key_id)
    if row is None or row.tenant_id != tenant_id or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    return True


async def ensure_bootstrap_key(session: AsyncSession, key: str, *, tenant_id: str = "default") -> bool:
    """Make sure tenant ``default`` exists and ``key`` is one of its admin keys; True if
    anything was created. Safe to run at every start."""
    created = False
    if await session.get(Tenant, tenant_id) is None:
        session.add(Tenant(id=tenant_id, name=tenant_id))
        await session.flush()
        created = True
    existing = (
        await session.execute(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    ).scalar_one_or_none()
    if existing is None:
        await issue_key(session, tenant_id=tenant_id, name="bootstrap", admin=True, key=key)
        created = True
    return created
