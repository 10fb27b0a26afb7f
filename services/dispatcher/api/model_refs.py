"""Models a job names by another job's published version, checked at the door.

``job:<job id or handle>@v<N>`` (or ``@latest``) names version N (or the newest) of one of
the tenant's jobs. It may stand for ``policy.init`` (the weights the job starts from) and
for the ``model`` setting of the reward components that load one (``reward_model``: a
reward model; ``judge``: a causal LM). At submission the reference is checked (the
tenant's job, a published version with full weights, of the right kind) and replaced in
the stored spec by the version's prefix in object storage, so ``@latest`` is pinned to the
latest at submission and everything downstream loads a model directory there.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from temper import registry
from temper.db import Job, PolicyVersion
from temper.jobspec import JobSpec, job_reference
from temper.problems import clip
from temper.provenance import local_dir

REWARD_MODEL = "reward_model"
MODEL_SETTING = "model"


class RefError(ValueError):
    """Why a job reference cannot be used (the message for the field)."""


async def job_version(
    session: AsyncSession, store: Any, tenant_id: str, ref: str
) -> tuple[Job, PolicyVersion, registry.Manifest]:
    """The job, version row and manifest ``ref`` (``job:<job>@v<N>|latest``) names; raises
    :class:`RefError`. Only full-weight versions can be loaded as a model."""
    parsed = job_reference(ref)
    if parsed is None:
        raise RefError(
            "a job's version is named job:<job id or handle>@v<N> or job:<job id or handle>@latest"
        )
    job_ref, number = parsed
    source = await session.get(Job, job_ref)
    if source is None or source.tenant_id != tenant_id:
        source = await session.scalar(select(Job).where(Job.tenant_id == tenant_id, Job.handle == job_ref))
    if source is None:
        raise RefError(f"no job of yours has the id or handle {clip(job_ref)}")
    query = select(PolicyVersion).where(PolicyVersion.job_id == source.id)
    query = query.where(PolicyVersion.version == number) if number is not None else query
    row = await session.scalar(query.order_by(PolicyVersion.version.desc()).limit(1))
    if row is None:
        what = f"no version v{number}" if number is not None else "no version yet"
        raise RefError(f"job {source.id} has published {what}")
    if store is None:
        raise RefError("no object store is configured to read the version from")
    try:
        manifest = await registry.read_manifest(store, row.checkpoint_key)
    except registry.CorruptVersion as exc:
        raise RefError(str(exc)) from None
    if manifest.kind != "full":
        raise RefError(
            f"v{row.version} of job {source.id} is a LoRA adapter; only full weights can be loaded as a model "
            "(train that job without algorithm.lora)"
        )
    return source, row, manifest


def _algorithm(job: Job) -> str | None:
    return ((job.spec or {}).get("algorithm") or {}).get("name")


async def init_errors(
    session: AsyncSession, *, spec: JobSpec, tenant_id: str, store: Any
) -> list[tuple[str, str]]:
    """``policy.init`` naming another job's version: the job is the tenant's, the version
    is published, holds full weights and is a policy (not a reward model), the job trained
    the same ``policy.model``, and the tokenizer this job would render with is the one the
    version was trained with. The spec then names the version's prefix in object storage.
    A key under another tenant's prefix is refused."""
    init = spec.policy.init
    if init is None:
        return []
    if init.startswith("tenants/") and not init.startswith(f"tenants/{tenant_id}/"):
        return [("policy.init", "names another tenant's objects; name a job of yours as job:<job>@v<N>")]
    if job_reference(init) is None:
        return []
    try:
        source, row, manifest = await job_version(session, store, tenant_id, init)
    except RefError as exc:
        return [("policy.init", str(exc))]
    if _algorithm(source) == REWARD_MODEL:
        return [("policy.init", f"job {source.id} trained a reward model; policy.init names a policy")]
    trained_on = (source.spec.get("policy") or {}).get("model")
    if trained_on != spec.policy.model:
        return [
            (
                "policy.init",
                f"v{row.version} of job {source.id} was trained from model {trained_on!r}, "
                f"not policy.model {spec.policy.model!r}",
            )
        ]
    own = local_dir(spec.policy.model)
    entry = manifest.files.get("tokenizer.json")
    if own is not None and (own / "tokenizer.json").is_file() and entry is not None:
        if hashlib.sha256((own / "tokenizer.json").read_bytes()).hexdigest() != entry.sha256:
            return [
                (
                    "policy.init",
                    f"v{row.version} of job {source.id} was trained with another tokenizer than "
                    f"policy.model's ({spec.policy.model})",
                )
            ]
    spec.policy.init = registry.prefix_of(row.checkpoint_key)
    return []


async def reward_model_errors(
    session: AsyncSession, *, spec: JobSpec, tenant_id: str, store: Any
) -> list[tuple[str, str]]:
    """The ``model`` setting of each reward component given with settings, where it names a
    job's version or an object-store key: the tenant's own, a reward model for
    ``reward_model`` and a causal LM for the others (a judge); a job reference is pinned to
    the version's prefix in the spec."""
    errors: list[tuple[str, str]] = []
    for name, settings in spec.reward_settings().items():
        ref = settings.get(MODEL_SETTING)
        if not isinstance(ref, str):
            continue
        field = f"rewards.{name}.{MODEL_SETTING}"
        if ref.startswith("tenants/") and not ref.startswith(f"tenants/{tenant_id}/"):
            errors.append((field, "names another tenant's objects; name a job of yours as job:<job>@v<N>"))
            continue
        if job_reference(ref) is None:
            continue
        try:
            source, row, _ = await job_version(session, store, tenant_id, ref)
        except RefError as exc:
            errors.append((field, str(exc)))
            continue
        is_rm = _algorithm(source) == REWARD_MODEL
        if name == REWARD_MODEL and not is_rm:
            errors.append(
                (field, f"job {source.id} is a {_algorithm(source)} job; name a reward_model job's version")
            )
            continue
        if name != REWARD_MODEL and is_rm:
            errors.append((field, f"job {source.id} trained a reward model; {name} needs a language model"))
            continue
        entry = spec.rewards[name]
        assert isinstance(entry, dict), "a component with settings is given as a mapping"
        entry[MODEL_SETTING] = registry.prefix_of(row.checkpoint_key)
    return errors
