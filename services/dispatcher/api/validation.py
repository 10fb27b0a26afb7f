"""Validation at the door: a job spec is checked at ``POST /v1/jobs`` against what this
deployment can run, so that nothing the scheduler reads later can surprise it.

Three layers, each refusing with ``(field path, message)`` pairs (:class:`SpecError`):

- the document: size, no YAML aliases (a 458-byte alias bomb expands to gigabytes),
  nesting depth, integers within 64 bits;
- the types: the spec is validated strictly (``"iterations": "5"`` is refused, not
  coerced to 5);
- the names: environment kind, action format, reward components (the plugins installed
  here, Temper's own included: ``temper.jobspec.plugin_errors``), model (a complete model
  directory, naming the file it lacks), backend pool and task set must be ones this
  deployment knows, with the allowed values and a "did you mean"; and a backend of the
  pool must be able to serve the model with what the job trains (``temper.policy.placement``);
- the chat template: it renders what the job's episodes will (:func:`template_errors`), or
  the job is refused with the template's own error.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import math
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api.episode_data import taskset_from_episodes
from services.dispatcher.api.model_refs import init_errors, reward_model_errors
from services.dispatcher.backends import deployment
from temper import problems
from temper.db import Job, Task, TaskSet
from temper.jobspec import OFFLINE_DATA, JobSpec, SpecError, plugin_errors, rl_only_errors
from temper.policy.placement import BackendInfo, missing_model_files, need_of, serve_error
from temper.problems import clip
from temper.provenance import local_dir
from temper.settings import Settings
from temper.tasks.service import TaskSetAmbiguous, TaskSetNotFound, get_taskset

log = logging.getLogger("temper.dispatcher.validation")

MAX_DEPTH = 32  # the spec's own nesting is 5; tool parameter schemas need a few more
MAX_NODES = 100_000
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_LISTED = 20  # allowed values named in one message


# --- the document -------------------------------------------------------------------------


class SpecLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-5`` as a string (its floats need a dot); people write learning
    rates that way, and with strict types a string is not a number. Read them as floats."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_events_ok(raw: bytes) -> None:
    """Walk the YAML event stream before building anything: refuse aliases and deep
    nesting while the document is still its own size."""
    depth = 0
    try:
        for event in yaml.parse(raw, Loader=SpecLoader):
            if isinstance(event, yaml.AliasEvent):
                raise SpecError([("(document)", "YAML aliases (*name) are not accepted in a job spec")])
            if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise SpecError([("(document)", f"nested deeper than {MAX_DEPTH} levels")])
            elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        raise SpecError([("(document)", f"not valid YAML: {problems.yaml_problem(exc)}")]) from None


def check_shape(data: Any) -> None:
    """Depth, size and integer range of a parsed document, walked without recursion."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    nodes = 0
    while stack:
        value, depth, path = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SpecError([("(document)", f"more than {MAX_NODES} values")])
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise SpecError([("(document)", f"nested deeper than {MAX_DEPTH} levels")])
            items: Iterable[tuple[object, Any]] = (
                value.items() if isinstance(value, dict) else enumerate(value)
            )
            for key, sub in items:
                stack.append((sub, depth + 1, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise SpecError([(path or "(root)", "integer out of the 64-bit range")])
        elif isinstance(value, float) and not math.isfinite(value):  # JSON has no NaN; Postgres refuses it
            raise SpecError([(path or "(root)", "not a finite number")])


def load_document(raw: bytes, *, json_body: bool) -> Any:
    """The parsed spec document (JSON, or YAML, which includes JSON), checked for shape."""
    if json_body:
        try:
            data = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecError([("(document)", f"not valid JSON: {str(exc)[:200]}")]) from None
        except RecursionError:
            raise SpecError([("(document)", f"nested deeper than {MAX_DEPTH} levels")]) from None
    else:
        _yaml_events_ok(raw)
        try:
            data = yaml.load(raw, Loader=SpecLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            raise SpecError([("(document)", f"not valid YAML: {problems.yaml_problem(exc)}")]) from None
    check_shape(data)
    return data


# --- the types ----------------------------------------------------------------------------


def strict_spec(data: Any) -> JobSpec:
    """Validate in pydantic's strict JSON mode: no string-to-number or string-to-bool
    coercion; enums and floats from JSON values as JSON allows."""
    if not isinstance(data, dict):
        raise SpecError([("(document)", "the spec must be a mapping")])
    if errors := rl_only_errors(data):
        raise SpecError(errors)
    try:
        text = json.dumps(data, default=str)  # YAML dates and the like become strings
    except (TypeError, ValueError) as exc:
        raise SpecError([("(document)", f"not representable as JSON: {str(exc)[:200]}")]) from None
    try:
        return JobSpec.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise SpecError(
            [(problems.field_path(e["loc"]), problems.message(e)) for e in exc.errors()]
        ) from None


# --- the names ----------------------------------------------------------------------------


def unknown(what: str, value: str, allowed: Iterable[str]) -> str:
    """ "unknown X 'v'; allowed: a, b (did you mean 'a'?)"."""
    options = sorted(set(allowed))
    listed = ", ".join(options[:MAX_LISTED]) + (", ..." if len(options) > MAX_LISTED else "")
    message = f"unknown {what} {clip(value)}; allowed: {listed or '(none)'}"
    close = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def known_models(settings: Settings, backends: list[BackendInfo]) -> set[str]:
    """Model names this deployment's gateway serves: its model name, what its backends'
    own weights answer to (served names, model directories, presets) and the names an
    operator lists in ``TEMPER_DISPATCHER__MODELS``. A model directory on this machine is
    also accepted. (Nothing here imports torch: the dispatcher stays small.)"""
    names = {settings.inference.model_name, *settings.dispatcher.models}
    for b in backends:
        names.update(b.models)
    return names


def model_errors(spec: JobSpec, settings: Settings, backends: list[BackendInfo]) -> list[tuple[str, str]]:
    """``policy.model`` is a model this deployment serves or a model directory here, and a
    directory (``policy.model`` or ``policy.init``) has every file a server and the trainer
    load; then some backend of the job's pool can serve it with what it trains."""
    errors = []
    models = known_models(settings, backends)
    for field, ref in (("policy.model", spec.policy.model), ("policy.init", spec.policy.init)):
        directory = local_dir(ref) if ref else None
        if directory is not None:
            missing = missing_model_files(directory)
            if missing:
                errors.append(
                    (field, f"{clip(ref)} is not a complete model directory: no {', '.join(missing)}")
                )
        elif field == "policy.model" and ref is not None and ref not in models:
            errors.append((field, unknown("model", ref, models) + " (or a model directory)"))
    if errors or not backends or spec.is_offline:
        # no backend list: this dispatcher cannot tell what the gateway serves; a job without
        # episodes (sft, dpo, reward_model) is served nothing
        return errors
    p = spec.policy
    need = need_of("", model=p.model, init=p.init, pool=p.backend_pool, lora=spec.algorithm.lora is not None)
    pools = {b.pool for b in backends}
    if p.backend_pool not in pools:
        return [("policy.backend_pool", unknown("backend pool", p.backend_pool, pools))]
    problem = serve_error(need, backends)
    if problem is not None:
        errors.append(("policy.init" if p.init else "policy.model", problem))
    return errors


async def image_errors(session: AsyncSession, *, spec: JobSpec, store: Any) -> list[tuple[str, str]]:
    """Every task image the job would run on (the environment's, its tasks'), published in
    object storage: a missing one is refused now, not at the first sandbox of an episode."""
    from temper.sandbox.images import ImageError, check_published

    named: list[tuple[str, Any]] = []
    if "image" in spec.environment.limits:
        named.append(("environment.limits.image", spec.environment.limits["image"]))
    rows = await session.execute(
        select(Task.spec["limits"]["image"].as_string())
        .where(Task.task_set_id == spec.tasks.taskset)
        .distinct()
    )
    named += [("tasks.taskset", digest) for digest in rows.scalars() if digest]
    errors = []
    for field, digest in named:
        try:
            if not isinstance(digest, str):
                raise ImageError(f"an image is a digest string, not {type(digest).__name__}")
            if store is None:
                raise ImageError(f"image {digest}: no object store is configured to hold it")
            await check_published(store, digest)
        except ImageError as e:
            errors.append((field, str(e)))
    return errors


async def limit_errors(session: AsyncSession, *, spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """The sandbox limits every episode would run with (each task's, overridden by the
    environment's) within this deployment's maxima and network rules: a request above a
    maximum is refused now, not clamped by the worker later. (Images: ``image_errors``.)"""
    from temper.limits import SandboxLimits
    from temper.sandbox.admission import limit_errors as policy_errors

    env = {k: v for k, v in spec.environment.limits.items() if k != "image"}
    rows = await session.execute(select(Task.spec["limits"]).where(Task.task_set_id == spec.tasks.taskset))
    distinct = {json.dumps(row, sort_keys=True, default=str): row for row in rows.scalars() if row}
    errors: dict[tuple[str, str], None] = {}
    for task_limits in [{}, *distinct.values()]:
        if not isinstance(task_limits, dict):
            continue
        merged = {**{k: v for k, v in task_limits.items() if k != "image"}, **env}

        def field(name: str) -> str:
            return f"environment.limits.{name}" if name in env else "tasks.taskset"

        try:
            limits = SandboxLimits.model_validate(merged)
        except ValidationError as exc:
            for e in exc.errors():
                name = str(e["loc"][0]) if e["loc"] else ""
                errors[
                    (field(name) if name else "environment.limits", f"sandbox limits: {problems.message(e)}")
                ] = None
            continue
        for name, message in policy_errors(limits, settings.sandbox):
            errors[(field(name), message if name in env else f"a task's limits: {message}")] = None
    return list(errors)


async def taskset_kind_errors(session: AsyncSession, *, spec: JobSpec) -> list[tuple[str, str]]:
    """A job without episodes trains on its kind of data (sft: chat tasks; dpo and
    reward_model: preference tasks); an RL job runs episodes on tasks that are neither."""
    kinds = set(
        (
            await session.execute(select(Task.kind).where(Task.task_set_id == spec.tasks.taskset).distinct())
        ).scalars()
    )
    wanted = spec.data_kind
    if wanted is not None and kinds - {wanted}:
        return [
            (
                "tasks.taskset",
                f"a {spec.algorithm.name} job trains on {wanted} tasks; this task set has "
                f"{', '.join(sorted(kinds - {wanted}))} tasks",
            )
        ]
    data = kinds & set(OFFLINE_DATA.values())
    if wanted is None and data:
        return [
            (
                "tasks.taskset",
                f"{' and '.join(sorted(data))} tasks are data for jobs without episodes (chat: sft; preference: "
                "dpo, reward_model); an RL job runs code, math or shell tasks",
            )
        ]
    return []


async def check_names(
    session: AsyncSession, *, spec: JobSpec, settings: Settings, tenant_id: str, store: Any = None
) -> None:
    """Every name the spec references, checked against this deployment; all problems at once."""
    errors = plugin_errors(spec)
    errors += await init_errors(session, spec=spec, tenant_id=tenant_id, store=store)
    errors += await reward_model_errors(session, spec=spec, tenant_id=tenant_id, store=store)
    errors += model_errors(spec, settings, await deployment(session, settings))
    # an sft job on another job's episodes: their task set is made now and named in the spec
    errors += await taskset_from_episodes(session, spec=spec, tenant_id=tenant_id, store=store)
    try:
        # a name stands for the one task set of the tenant with it: the job keeps the id
        spec.tasks.taskset = (await get_taskset(session, spec.tasks.taskset, tenant=tenant_id)).id
    except TaskSetAmbiguous as exc:
        errors.append(("tasks.taskset", str(exc)))
    except TaskSetNotFound:
        if spec.tasks.taskset:  # none is named when from_job's set could not be made (its error says why)
            rows = await session.execute(
                select(TaskSet.id, TaskSet.name).where(TaskSet.tenant_id == tenant_id)
            )
            known = {ref for row in rows for ref in row}
            errors.append(
                ("tasks.taskset", unknown("task set", spec.tasks.taskset, known) + " (an id or a name)")
            )
    prior = spec.tasks.prior_from_job
    if prior is not None:
        job = await session.get(Job, prior)
        if job is None or job.tenant_id != tenant_id:
            errors.append(("tasks.prior_from_job", f"unknown job {clip(prior)}: no job of yours has that id"))
        elif (job.spec.get("tasks") or {}).get("taskset") != spec.tasks.taskset:
            ran_on = (job.spec.get("tasks") or {}).get("taskset")
            errors.append(
                (
                    "tasks.prior_from_job",
                    f"job {prior} ran on task set {ran_on!r}, not {spec.tasks.taskset!r}",
                )
            )
    if spec.tasks.taskset and not any(path == "tasks.taskset" for path, _ in errors):
        errors += await taskset_kind_errors(session, spec=spec)
    errors += await image_errors(session, spec=spec, store=store)
    errors += await limit_errors(session, spec=spec, settings=settings)
    errors += agent_errors(spec, settings)
    if errors:
        raise SpecError(errors)


def agent_errors(spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """Kind agent needs the gateway's address as sandboxes reach it, and a sandbox network
    through which they do (the allowlist, which the episode's run gets the gateway added to)."""
    from temper.jobspec import AGENT_KIND

    env = spec.environment
    if env.kind != AGENT_KIND:
        return []
    errors = []
    if settings.agent.url is None:
        errors.append(
            ("environment.kind", "kind agent needs the gateway's address for sandboxes: this deployment does "
             "not set TEMPER_AGENT__URL")
        )  # fmt: skip
    network = env.limits.get("network")
    if network not in (None, "allowlist"):
        errors.append(
            ("environment.limits.network", f"an agent reaches the gateway through the allowlist proxy: "
             f"allowlist (or leave it out), not {network}")
        )  # fmt: skip
    return errors


async def template_errors(
    session: AsyncSession, *, spec: JobSpec, store: Any = None
) -> list[tuple[str, str]]:
    """The job's chat template renders what its episodes will, for one of its tasks
    (``temper.envs.Environment.check_template``): the first prompt with the job's tools, an
    assistant turn that calls a tool and the tool's result (in ``environment.tool_role``),
    and the token-wise continuation with that result. A template that cannot is refused
    now with its own error, under the field whose model gave it, not in the first
    episode. (A model directory that does not load is ``model_errors``' to report.)"""
    from temper.envs import environment_options, make_environment
    from temper.policy.tokenizer import (
        TemplateError,
        fetch_policy_tokenizer,
        policy_tokenizer,
        tokenizer_source,
    )

    p, env = spec.policy, spec.environment
    field = f"policy.{tokenizer_source(p.model, p.init) or 'model'}"
    try:
        if store is not None:
            cache = Path(tempfile.gettempdir()) / "temper-tokenizers"
            await fetch_policy_tokenizer(store, p.model, p.init, cache)
        tok = await asyncio.to_thread(policy_tokenizer, p.model, p.init)
        field = f"policy.{tokenizer_source(p.model, p.init) or 'model'}"
    except TemplateError as exc:
        return [(field, f"{clip(p.init if field == 'policy.init' else p.model)}: {exc}")]
    except Exception as exc:  # noqa: BLE001 - a directory that does not load is model_errors'
        log.debug("template check skipped: the tokenizer did not load: %s", exc)
        return []
    row = (
        await session.execute(
            select(Task.id, Task.kind, Task.prompt, Task.spec, Task.meta)
            .where(Task.task_set_id == spec.tasks.taskset)
            .order_by(Task.id)
            .limit(1)
        )
    ).first()
    task = dict(row._mapping) if row is not None else {"id": "probe", "kind": env.kind, "prompt": "Probe."}
    try:
        environment = make_environment(env.kind or str(task["kind"]), task, **environment_options(env))
    except Exception as exc:  # noqa: BLE001 - names and packages are checked elsewhere
        log.debug("template check skipped: the environment did not build: %s", exc)
        return []
    try:
        await asyncio.to_thread(environment.check_template, tok)
    except TemplateError as exc:
        return [(field, f"its chat template cannot render this job's episodes: {exc}")]
    except Exception as exc:  # noqa: BLE001 - an environment's own bug is not the template's
        log.warning("template check skipped: the environment failed: %s", exc)
    return []


async def check_template(session: AsyncSession, *, spec: JobSpec, store: Any = None) -> None:
    """:func:`template_errors` as a :class:`SpecError` (after the package is pinned: a
    package's tools are part of what the template must render)."""
    errors = await template_errors(session, spec=spec, store=store)
    if errors:
        raise SpecError(errors)
