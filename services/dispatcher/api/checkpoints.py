"""``/v1/jobs/{id}/checkpoints``: a job's published policy versions, and each one as a
directory you can load: a Hugging Face model directory for a full-weight version, a PEFT
adapter directory for a LoRA version (``?with_base=true`` adds the base model under
``base/``), streamed as an uncompressed tar with the version's ``manifest.json`` first
(``temper checkpoints JOB --download V -o DIR`` unpacks and checks it)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response, status
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select

from services.dispatcher.api import schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import RuntimeDep, SessionDep, StoreDep
from services.dispatcher.api.jobs import AUTH, NOT_FOUND, JobDep
from temper import registry
from temper.db import Job, PolicyVersion
from temper.settings import Mode
from temper.storage import NotFound, ObjectStore

router = APIRouter(tags=["export"], dependencies=[Depends(bearer_scheme)])

MAX_BASE_FILES = 4096


class Checkpoint(BaseModel):
    version: int
    step: int
    created_at: datetime
    metrics: dict[str, Any]


@router.get(
    "/v1/jobs/{job_id}/checkpoints",
    summary="A job's published policy versions",
    response_model=list[Checkpoint],
    responses={**NOT_FOUND, **AUTH},
)
async def list_checkpoints(session: SessionDep, job: JobDep) -> list[Checkpoint]:
    rows = await session.execute(
        select(PolicyVersion).where(PolicyVersion.job_id == job.id).order_by(PolicyVersion.version)
    )
    return [
        Checkpoint(version=r.version, step=r.step, created_at=r.created_at, metrics=r.metrics or {})
        for r in rows.scalars()
    ]


def _local_model(name: str) -> dict[str, bytes] | None:
    """The files of a model directory on this server's disk, or None if ``name`` is none."""
    root = FilePath(name)
    if not (root / "config.json").is_file():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files[:MAX_BASE_FILES]}


async def base_files(job: Job, store: ObjectStore, *, embedded: bool) -> dict[str, bytes]:
    """The files of the model a LoRA job's adapters apply to (``policy.init``, else
    ``policy.model``): a model directory on this server's disk (embedded mode only: one
    user, their own disk), or in the object store under the job's tenant (a prefix of a
    model directory, or a published full version). 409 otherwise (another tenant's key,
    the trainer's random-weight preset)."""
    policy = (job.spec or {}).get("policy", {})
    name = str(policy.get("init") or policy.get("model") or "")
    local = await asyncio.to_thread(_local_model, name) if name and embedded else None
    if local is not None:
        return local
    if not embedded and not name.startswith(f"{job.tenant_id}/"):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"the base model of job {job.id} ({name or 'the trainer preset'}) is not stored under tenant "
            f"{job.tenant_id!r}; download the adapter alone and load it on your copy of the base",
        )
    if registry.is_manifest_key(name):
        _, version_files = await registry.fetch_files(store, name)
        return version_files
    prefix = name.rstrip("/") + "/"
    keys = await store.list(prefix) if name and not name.endswith(".safetensors") else []
    if prefix + "config.json" in keys:
        return {k[len(prefix) :]: await store.get(k) for k in keys[:MAX_BASE_FILES]}
    raise HTTPException(
        status.HTTP_409_CONFLICT,
        f"the base model of job {job.id} ({name or 'the trainer preset'}) is not a model directory this "
        "server can read; download the adapter alone and load it on your copy of the base",
    )


@router.get(
    "/v1/jobs/{job_id}/checkpoints/{version}",
    summary="Download a policy version as a loadable directory (tar)",
    description="A full-weight version is a Hugging Face model directory (config, safetensors, tokenizer "
    "with its chat template); a LoRA version is a PEFT adapter directory, with the base model under base/ "
    "when with_base is true. The archive is an uncompressed tar whose first member is manifest.json: the "
    "SHA-256 and size of every file (the base's files are not in it).",
    response_class=Response,
    responses={
        200: {"description": "the version", "content": {"application/x-tar": {}}},
        404: {"model": schemas.Problem, "description": "no such job, version, or its files were deleted"},
        409: {"model": schemas.Problem, "description": "with_base, and the base cannot be read here"},
        422: {"model": schemas.Problem, "description": "with_base on a full-weight version"},
        **AUTH,
    },
)
async def download_checkpoint(
    session: SessionDep,
    store: StoreDep,
    runtime: RuntimeDep,
    job: JobDep,
    version: Annotated[int, Path(ge=1, le=2**31 - 1)],
    with_base: Annotated[bool, Query(description="add the base model of a LoRA version under base/")] = False,
) -> Response:
    row = await session.get(PolicyVersion, (job.id, version))
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job.id} has no policy version {version}")
    if not registry.is_manifest_key(row.checkpoint_key):  # a version published before the registry
        try:
            data = await store.get(row.checkpoint_key)
        except NotFound:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"the weights of version {version} were deleted"
            ) from None
        headers = {"Content-Disposition": f'attachment; filename="{job.id}-v{version}.safetensors"'}
        return Response(data, media_type="application/octet-stream", headers=headers)
    try:
        manifest = await registry.read_manifest(store, row.checkpoint_key)
    except registry.CorruptVersion as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"version {version} cannot be read: {exc}") from None
    if with_base and manifest.kind != "lora":
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"version {version} holds full weights, a complete model: with_base applies to LoRA versions",
        )
    embedded = runtime.settings.mode is Mode.embedded
    base = await base_files(job, store, embedded=embedded) if with_base else None
    headers = {
        "Content-Disposition": f'attachment; filename="{job.id}-v{version}.tar"',
        "X-Temper-Version-Kind": manifest.kind,
        "X-Temper-Base-Model": manifest.base_model,
    }
    return StreamingResponse(
        registry.version_archive(store, row.checkpoint_key, base=base),
        media_type="application/x-tar",
        headers=headers,
    )
