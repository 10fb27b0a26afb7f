"""The caller's tenant and its API keys; creating tenants and setting quotas (admin keys)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, status
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api import repo, schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import AdminCaller, CurrentCaller, SessionDep
from services.dispatcher.fairshare import QUOTAS, tenant_usage
from temper.db import ApiKey, Tenant
from temper.tenants import TenantExists, create_tenant, issue_key, revoke_key

router = APIRouter(prefix="/v1", tags=["tenants"], dependencies=[Depends(bearer_scheme)])

AUTH: schemas.Responses = {401: {"model": schemas.Problem, "description": "missing or invalid API key"}}
INT32_MAX = (1 << 31) - 1  # key ids are 32-bit integer columns
ADMIN: schemas.Responses = {**AUTH, 403: {"model": schemas.Problem, "description": "needs an admin key"}}


async def _detail(session: AsyncSession, t: Tenant) -> schemas.TenantDetail:
    used = (await tenant_usage(session, [t.id]))[t.id]
    return schemas.TenantDetail(
        **schemas.TenantOut.model_validate(t).model_dump(),
        active_episodes=await repo.active_episodes(session, tenant_id=t.id),
        used_sandbox_cpu_s=used.sandbox_cpu_s,
        used_inference_tokens=used.inference_tokens,
        used_sandbox_memory_gb_s=used.sandbox_memory_gb_s,
        used_trainer_s=used.trainer_s,
    )


@router.get(
    "/tenant",
    summary="The caller's tenant: weight, quotas and usage",
    response_model=schemas.TenantUsage,
    responses=AUTH,
)
async def my_tenant(session: SessionDep, caller: CurrentCaller) -> schemas.TenantUsage:
    detail = await _detail(session, caller.tenant)
    return schemas.TenantUsage(**detail.model_dump(), admin=caller.admin)


@router.get(
    "/keys",
    summary="The tenant's API keys (prefixes only)",
    response_model=list[schemas.KeyOut],
    responses=AUTH,
)
async def list_keys(session: SessionDep, caller: CurrentCaller) -> list[ApiKey]:
    rows = await session.execute(
        select(ApiKey).where(ApiKey.tenant_id == caller.tenant.id).order_by(ApiKey.id)
    )
    return list(rows.scalars())


@router.post(
    "/keys",
    summary="Create an API key for the caller's tenant",
    status_code=201,
    description="The key is in this response only; it is stored as a sha256 hash.",
    response_model=schemas.NewKey,
    responses=AUTH,
)
async def create_key(body: schemas.CreateKey, session: SessionDep, caller: CurrentCaller) -> schemas.NewKey:
    issued = await issue_key(session, tenant_id=caller.tenant.id, name=body.name)
    await session.commit()
    return schemas.NewKey(
        id=issued.id, tenant_id=issued.tenant_id, prefix=issued.prefix, admin=issued.admin, key=issued.key
    )


@router.delete(
    "/keys/{key_id}",
    summary="Revoke an API key",
    status_code=204,
    responses={404: {"model": schemas.Problem}, **AUTH},
)
async def delete_key(
    key_id: Annotated[int, Path(ge=1, le=INT32_MAX)], session: SessionDep, caller: CurrentCaller
) -> None:
    if not await revoke_key(session, tenant_id=caller.tenant.id, key_id=key_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"key {key_id} not found")
    await session.commit()


@router.get(
    "/tenants", summary="List tenants (admin)", response_model=list[schemas.TenantOut], responses=ADMIN
)
async def list_tenants(session: SessionDep, _admin: AdminCaller) -> list[Tenant]:
    return list((await session.execute(select(Tenant).order_by(Tenant.id))).scalars())


@router.post(
    "/tenants",
    summary="Create a tenant and its first key (admin)",
    status_code=201,
    response_model=schemas.NewTenant,
    responses={**ADMIN, 409: {"model": schemas.Problem, "description": "the tenant id is taken"}},
)
async def new_tenant(
    body: schemas.CreateTenant, session: SessionDep, _admin: AdminCaller
) -> schemas.NewTenant:
    try:
        tenant, issued = await create_tenant(
            session,
            name=body.name,
            tenant_id=body.id,
            max_concurrent_episodes=body.max_concurrent_episodes,
            admin=body.admin,
            weight=body.weight,
            quota_sandbox_cpu_s=body.quota_sandbox_cpu_s,
            quota_inference_tokens=body.quota_inference_tokens,
            quota_sandbox_memory_gb_s=body.quota_sandbox_memory_gb_s,
            quota_trainer_s=body.quota_trainer_s,
        )
    except TenantExists as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    await session.commit()
    return schemas.NewTenant(
        tenant=schemas.TenantOut.model_validate(tenant),
        key=schemas.NewKey(
            id=issued.id, tenant_id=tenant.id, prefix=issued.prefix, admin=issued.admin, key=issued.key
        ),
    )


@router.get(
    "/tenants/{tenant_id}",
    summary="A tenant: weight, quotas and usage (admin)",
    response_model=schemas.TenantDetail,
    responses={**ADMIN, 404: {"model": schemas.Problem}},
)
async def get_tenant(tenant_id: str, session: SessionDep, _admin: AdminCaller) -> schemas.TenantDetail:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"tenant {tenant_id} not found")
    return await _detail(session, tenant)


@router.patch(
    "/tenants/{tenant_id}",
    summary="Rename a tenant or set its quotas and weight (admin)",
    description="A quota given as null is lifted; a job paused for a quota resumes once its "
    "tenant is within its quotas again.",
    response_model=schemas.TenantOut,
    responses={**ADMIN, 404: {"model": schemas.Problem}},
)
async def update_tenant(
    tenant_id: str, body: schemas.UpdateTenant, session: SessionDep, _admin: AdminCaller
) -> Tenant:
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"tenant {tenant_id} not found")
    if body.name is not None:
        tenant.name = body.name
    if body.max_concurrent_episodes is not None:
        tenant.max_concurrent_episodes = body.max_concurrent_episodes
    if body.weight is not None:
        tenant.weight = body.weight
    # an explicit null lifts a quota; a field left out keeps it
    for quota in QUOTAS:
        if quota in body.model_fields_set:
            setattr(tenant, quota, getattr(body, quota))
    await session.commit()
    return tenant
