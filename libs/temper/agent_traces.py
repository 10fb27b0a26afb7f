"""The model calls of agent episodes (``environment.kind: agent``), kept for training.

An agent episode runs the user's program in its sandbox; the program calls the policy at
the episode's own base URL on the gateway (``/agent/<episode>/v1``) with the episode's key.
This module is what the dispatcher and the gateway share about it:

- **Keys.** The dispatcher issues a key in the transaction that starts the agent
  (:func:`issue_key`): the key goes to the sandbox, its SHA-256 to ``agent_keys``. The
  gateway takes a call only with the key of the episode its URL names, before the key
  expires and while the episode is acting (:func:`credential`): one episode cannot write
  into another's trace, and an episode that is being scored takes no more calls.
- **Calls.** The gateway records each call it answered (:func:`record_call`): the body
  (prompt ids, sampled ids and their logprobs, the policy version, the messages) is put in
  object storage first, then the ``agent_calls`` row that points at it is written, and
  only then is the call answered, so every call an agent saw an answer to is on record
  before its program can exit. The dispatcher reads them back in order
  (:func:`calls_of`) to build the episode's trajectory token for token.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.sql import Executable

from temper.db import AgentCall, AgentKey, Database, Episode, rows
from temper.db.core import CoreTx, core_of
from temper.db.rows import HasInfo
from temper.storage import ObjectStore, object_key

KEY_PREFIX = "tmpa-"


def new_key() -> str:
    """A fresh episode key (``tmpa-`` and 43 URL-safe characters, 256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def issue_key(session: HasInfo, *, episode_id: str, job_id: str, tenant_id: str, expires_at: datetime) -> str:
    """A key for ``episode_id``'s agent, its row staged on ``session`` (written when the
    transaction commits, with the episode's own rows); returns the key itself."""
    key = new_key()
    row = rows.new(
        AgentKey,
        key_hash=key_hash(key),
        episode_id=episode_id,
        job_id=job_id,
        tenant_id=tenant_id,
        expires_at=expires_at,
    )
    rows.stage(session, row)
    return key


class KeyRefused(Exception):
    """A call the agent proxy does not take: ``status`` (401 or 403) and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Credential:
    """Whose call it is: the episode (its job, tenant, the attempt of its agent run)."""

    episode_id: str
    job_id: str
    tenant_id: str
    attempt: int


_k, _e = AgentKey.__table__.c, Episode.__table__.c
_CREDENTIAL = (
    select(_k.episode_id, _k.job_id, _k.tenant_id, _k.expires_at, _e.state, _e.attempt)
    .join_from(AgentKey.__table__, Episode.__table__, _e.id == _k.episode_id)
    .where(_k.key_hash == bindparam("key_hash"))
)


async def credential(db: Database, key: str | None, episode_id: str, *, now: datetime) -> Credential:
    """The credential ``key`` gives for a call to ``episode_id``'s base URL, or
    :class:`KeyRefused`: no key or an unknown one (401), another episode's key (403), an
    expired key or an episode that is no longer acting (403)."""
    if not key:
        raise KeyRefused(401, "no key: send the episode's key as Authorization: Bearer <OPENAI_API_KEY>")
    async with db.engine.connect() as conn:
        row = (await conn.execute(_CREDENTIAL, {"key_hash": key_hash(key)})).first()
    if row is None:
        raise KeyRefused(401, "unknown key")
    owner, job_id, tenant_id, expires_at, state, attempt = row
    if owner != episode_id:
        raise KeyRefused(403, f"this key belongs to another episode, not {episode_id}")
    if expires_at <= now:
        raise KeyRefused(403, f"the episode's key expired at {expires_at.isoformat()}")
    if state != "acting":
        raise KeyRefused(403, f"episode {episode_id} is {state}: its agent's calls are closed")
    return Credential(episode_id=owner, job_id=job_id, tenant_id=tenant_id, attempt=int(attempt))


class CallRecord(BaseModel):
    """One call's body, as stored: everything the trainer and a person need of it."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    request_id: str
    episode_id: str
    job_id: str
    attempt: int
    created_at: float = Field(default_factory=time.time)
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    backend: str = ""
    finish_reason: str | None = None
    text: str = Field("", description="the sampled text as the engine gave it")
    messages: list[dict[str, Any]] = Field(default_factory=list, description="the request's messages")
    tools: list[dict[str, Any]] | None = None
    reply: dict[str, Any] = Field(default_factory=dict, description="the assistant message answered")
    sampling: dict[str, Any] = Field(default_factory=dict, description="what the call was sampled with")
    extends: bool = Field(
        False, description="its prompt extends the previous call's prompt and sampled ids token for token"
    )


def call_key(tenant_id: str, record: CallRecord) -> str:
    return object_key(tenant_id, record.job_id, "agent-calls", record.episode_id, f"{record.request_id}.json")


async def record_call(db: Database, store: ObjectStore, tenant_id: str, record: CallRecord) -> None:
    """Put ``record``'s body, then write its row (a row always points at a body)."""
    key = call_key(tenant_id, record)
    await store.put(key, record.model_dump_json().encode(), "application/json")
    async with db.session() as s:
        s.add(
            AgentCall(
                episode_id=record.episode_id,
                job_id=record.job_id,
                attempt=record.attempt,
                request_id=record.request_id,
                policy_version=record.policy_version,
                prompt_tokens=len(record.prompt_ids),
                completion_tokens=len(record.token_ids),
                finish_reason=record.finish_reason,
                extends=record.extends,
                body_key=key,
            )
        )


_c = AgentCall.__table__.c
_LAST_ATTEMPT = select(func.max(_c.attempt)).where(_c.episode_id == bindparam("episode_id"))
_KEYS = (
    select(_c.body_key)
    .where(_c.episode_id == bindparam("episode_id"), _c.attempt == bindparam("attempt"))
    .order_by(_c.id)
)
_COUNT = select(func.count()).where(
    _c.episode_id == bindparam("episode_id"), _c.attempt == bindparam("attempt")
)
_LAST_KEY = _KEYS.order_by(None).order_by(_c.id.desc()).limit(1)


async def call_count(conn: AsyncConnection, episode_id: str, attempt: int) -> int:
    """How many calls ``episode_id``'s agent run ``attempt`` made."""
    return int((await conn.execute(_COUNT, {"episode_id": episode_id, "attempt": attempt})).scalar_one())


async def calls_of(
    tx: CoreTx | AsyncSession | AsyncConnection, store: ObjectStore, episode_id: str
) -> list[CallRecord]:
    """The calls of the episode's last agent run (an earlier attempt that failed left its
    own calls, which are not this run's), in the order the gateway recorded them."""

    async def rows(stmt: Executable, params: dict[str, object]) -> list[Any]:
        if isinstance(tx, AsyncConnection):
            return list(await tx.execute(stmt, params))
        return await (await core_of(tx)).rows(stmt, params)

    ((attempt,),) = await rows(_LAST_ATTEMPT, {"episode_id": episode_id})
    if attempt is None:
        return []
    keys = [r[0] for r in await rows(_KEYS, {"episode_id": episode_id, "attempt": attempt})]
    bodies = await asyncio.gather(*(store.get(k) for k in keys))
    return [CallRecord.model_validate_json(b) for b in bodies]


async def last_call(db: Database, store: ObjectStore, episode_id: str, attempt: int) -> CallRecord | None:
    """The newest call of ``episode_id``'s run ``attempt`` (a gateway that did not see it
    resumes the conversation from it)."""
    async with db.engine.connect() as conn:
        key = (await conn.execute(_LAST_KEY, {"episode_id": episode_id, "attempt": attempt})).scalar()
    return None if key is None else CallRecord.model_validate_json(await store.get(str(key)))
