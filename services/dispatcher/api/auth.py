"""API-key authentication: ``Authorization: Bearer <key>``.

A missing, malformed, unknown or revoked key is a 401 with ``WWW-Authenticate: Bearer``;
an admin-only route called with a tenant key is a 403. Keys are never logged: only the
sha256 of the presented key is looked up.
"""

from __future__ import annotations

from fastapi import HTTPException, Request, status
from fastapi.security import HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from temper.tenants import Caller, authenticate

# Declares the scheme in the OpenAPI document; parsing is done below so that every
# failure answers the same 401.
bearer_scheme = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer tmp_...`")


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


def bearer_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


async def require_caller(request: Request, session: AsyncSession) -> Caller:
    key = bearer_key(request)
    if key is None:
        raise unauthorized("missing API key: send `Authorization: Bearer <key>`")
    caller = await authenticate(session, key)
    if caller is None:
        raise unauthorized("invalid or revoked API key")
    request.state.tenant_id = caller.tenant.id
    return caller


def require_admin(caller: Caller) -> Caller:
    if not caller.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this needs an admin API key")
    return caller
