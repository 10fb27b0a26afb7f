"""``/v1/environments``: upload a tenant environment package (a tar.gz with
``environment.yaml`` at its top), list the tenant's packages, read one. Another tenant's
package is a 404 everywhere; the work is the package library's (:mod:`temper.envpkg.service`).
The dispatcher's app mounts the router:

    app.include_router(make_router(CurrentTenant))
"""

# no `from __future__ import annotations`: FastAPI must see the dependency aliases made in make_router
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse

from services.dispatcher.api.bodies import read_limited
from services.dispatcher.api.tasksets import runtime_from_app, tenant_id_of
from temper.envpkg import service
from temper.envpkg.archive import MAX_ARCHIVE_BYTES, PackageError
from temper.envpkg.models import ManifestError
from temper.runtime import Runtime

ARCHIVE_TYPES = ("application/gzip", "application/x-gzip", "application/octet-stream", "application/x-tar")


def manifest_problem(exc: ManifestError) -> JSONResponse:
    field, line, message = exc.errors[0]
    where = f" (line {line})" if line else ""
    body = {
        "detail": f"invalid environment.yaml: {field}{where}: {message[:300]}",
        "errors": [
            {"field": f, "line": n, "message": f"line {n}: {m[:300]}" if n else m[:300]}
            for f, n, m in exc.errors[:100]
        ],
    }
    return JSONResponse(body, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def make_router(
    tenant_dependency: Callable[..., Any],
    *,
    runtime_dependency: Callable[..., Runtime] = runtime_from_app,
) -> APIRouter:
    router = APIRouter(prefix="/v1/environments", tags=["environments"])
    TenantDep = Annotated[Any, Depends(tenant_dependency)]  # noqa: N806 - a type alias
    RuntimeDep = Annotated[Runtime, Depends(runtime_dependency)]  # noqa: N806

    @router.post(
        "",
        status_code=status.HTTP_201_CREATED,
        summary="Upload an environment package (tar.gz)",
        description="The body is a gzip'd tar with environment.yaml at its top. A manifest that does not "
        "validate is a 422 naming each field and its line; a version that exists with other content is a "
        "409 (versions are immutable); the same archive again is a 200.",
        # the body is read as a stream, so FastAPI cannot infer it: declare it for clients
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in ARCHIVE_TYPES},
            }
        },
    )
    async def upload(request: Request, response: Response, tenant: TenantDep, runtime: RuntimeDep) -> Any:
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype not in ARCHIVE_TYPES:
            raise HTTPException(
                status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send the package as application/gzip (a tar.gz)"
            )
        data = await read_limited(request, MAX_ARCHIVE_BYTES, "the package")
        assert runtime.store is not None
        try:
            meta, created = await service.upload(runtime.store, tenant_id=tenant_id_of(tenant), data=data)
        except ManifestError as exc:
            return manifest_problem(exc)
        except PackageError as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"invalid package: {exc}") from None
        except service.VersionTaken as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        if not created:
            response.status_code = status.HTTP_200_OK
        return meta

    @router.get("", summary="The tenant's environment packages")
    async def list_all(tenant: TenantDep, runtime: RuntimeDep) -> list[dict[str, Any]]:
        assert runtime.store is not None
        return await service.list_packages(runtime.store, tenant_id=tenant_id_of(tenant))

    @router.get("/{name}/{version}", summary="One environment package (its manifest and file list)")
    async def show(name: str, version: str, tenant: TenantDep, runtime: RuntimeDep) -> dict[str, Any]:
        assert runtime.store is not None
        meta = await service.get(runtime.store, tenant_id=tenant_id_of(tenant), name=name, version=version)
        if meta is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"environment {name} {version} not found")
        return meta

    return router
