"""Typed dependencies of the API's routes: the runtime, a database session, the object
store and the calling tenant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api.auth import require_admin, require_caller
from temper.db import Tenant
from temper.runtime import Runtime
from temper.storage import ObjectStore
from temper.tenants import Caller


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime  # type: ignore[no-any-return]


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_session(runtime: RuntimeDep) -> AsyncIterator[AsyncSession]:
    """A session for one request. Nothing is committed unless the route commits: a route
    that raises leaves no trace."""
    assert runtime.db is not None
    async with runtime.db.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def get_store(runtime: RuntimeDep) -> ObjectStore:
    assert runtime.store is not None
    return runtime.store


StoreDep = Annotated[ObjectStore, Depends(get_store)]


async def current_caller(request: Request, session: SessionDep) -> Caller:
    return await require_caller(request, session)


CurrentCaller = Annotated[Caller, Depends(current_caller)]


def current_tenant(caller: CurrentCaller) -> Tenant:
    return caller.tenant


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def admin_caller(caller: CurrentCaller) -> Caller:
    return require_admin(caller)


AdminCaller = Annotated[Caller, Depends(admin_caller)]
