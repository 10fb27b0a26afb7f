"""What a launched run needs from the real stack before its services start: the stack's
addresses (the environment or ``.stack/env``), free ports, a fresh database, consumer
groups of the run set to the end of the shared topics, uploads to the object store, the
sandbox root, and the ``local:`` block's overrides of the spec."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import tempfile
from pathlib import Path
from typing import Any

from services.embedded import localrun
from temper.jobspec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
STACK_KEYS = (
    "TEMPER_DB__URL",
    "TEMPER_BUS__BOOTSTRAP",
    "TEMPER_STORAGE__ENDPOINT",
    "TEMPER_STORAGE__ACCESS_KEY",
    "TEMPER_STORAGE__SECRET_KEY",
    "TEMPER_STORAGE__BUCKET",
    "TEMPER_REDIS__URL",
)


class StackError(RuntimeError):
    """Something the run cannot go on without; the message says what."""


# --- settings of the run --------------------------------------------------------------------


def stack_env(path: Path = ROOT / ".stack" / "env") -> dict[str, str]:
    """The stack's addresses: ``.stack/env`` (written by ``make stack-up``), overridden by
    the same variables in the environment."""
    env: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip().removeprefix("export ")
            if "=" in line and not line.startswith("#"):
                name, _, value = line.partition("=")
                env[name] = shlex.split(value)[0] if value else ""
    env.update({k: v for k in STACK_KEYS if (v := os.environ.get(k))})
    missing = [
        k for k in ("TEMPER_DB__URL", "TEMPER_BUS__BOOTSTRAP", "TEMPER_STORAGE__ENDPOINT") if k not in env
    ]
    if missing:
        raise StackError(f"{', '.join(missing)} not set and no {path}: start the stack with `make stack-up`")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def apply_overrides(
    spec: JobSpec, local: localrun.LocalRun, args: argparse.Namespace
) -> tuple[JobSpec, localrun.LocalRun]:
    """``--iterations``, ``--episodes``, ``--group-size``, ``--warm-start-steps``: a quicker run of the same job."""
    schedule: dict[str, Any] = {}
    if args.iterations is not None:
        schedule["iterations"] = args.iterations
    if args.episodes is not None:
        schedule["episodes_per_iteration"] = args.episodes
        schedule["max_concurrent_episodes"] = min(spec.schedule.max_concurrent_episodes, args.episodes)
    tasks = spec.tasks.model_copy(update={"group_size": args.group_size}) if args.group_size else spec.tasks
    algorithm = spec.algorithm
    if args.episodes is not None:
        groups = args.episodes // tasks.group_size
        algorithm = algorithm.model_copy(
            update={"groups_per_step": max(1, min(algorithm.groups_per_step, groups))}
        )
    doc = spec.model_dump(mode="json")
    doc["schedule"].update(schedule)
    doc["tasks"] = tasks.model_dump(mode="json")
    doc["algorithm"] = algorithm.model_dump(mode="json")
    spec = JobSpec.model_validate(doc)  # re-checks episodes_per_iteration % group_size
    if args.warm_start_steps is not None and local.warm_start is not None:
        ws: localrun.WarmStart | None = None  # 0 steps: no warm start
        if args.warm_start_steps > 0:
            ws = local.warm_start.model_copy(update={"steps": args.warm_start_steps})
        local = local.model_copy(update={"warm_start": ws})
    return spec, local


# --- the database, the object store, the bus -----------------------------------------------------


async def admin_sql(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def fresh_database(stack_url: str, name: str) -> str:
    """Create database ``name`` beside the stack's own and return its URL."""
    asyncio.run(admin_sql(stack_url, f'CREATE DATABASE "{name}"'))
    return stack_url.rsplit("/", 1)[0] + f"/{name}"


def storage_settings(env: dict[str, str]) -> Any:
    from pydantic import SecretStr

    from temper.settings import StorageKind, StorageSettings

    return StorageSettings(
        kind=StorageKind.s3,
        endpoint=env["TEMPER_STORAGE__ENDPOINT"],
        access_key=env.get("TEMPER_STORAGE__ACCESS_KEY", "temper"),
        secret_key=SecretStr(env.get("TEMPER_STORAGE__SECRET_KEY", "temper-secret-key")),
        bucket=env.get("TEMPER_STORAGE__BUCKET", "temper"),
    )


async def upload_files(env: dict[str, str], files: dict[str, bytes], prefix: str) -> None:
    """``files`` (name -> bytes) to ``prefix/<name>`` in the stack's bucket."""
    from temper.storage import S3Store

    store = S3Store(storage_settings(env))
    await store.ensure_bucket()
    for name, data in files.items():
        await store.put(f"{prefix}/{name}", data)


async def groups_start_at_end(
    bootstrap: str, groups: dict[str, tuple[str, ...]], namespace: str = ""
) -> None:
    """Create the topics if need be and commit their end offsets for each new group: a new
    group would otherwise start at the earliest offset and replay what others left.
    ``namespace`` is the bus setting of that name (put in front of topics and groups)."""
    from temper.bus import KafkaBus
    from temper.bus.kafka import start_groups_at_end
    from temper.events import Topics

    bus = KafkaBus(bootstrap=bootstrap, namespace=namespace)
    await bus.start()
    try:
        await bus.create_topics(Topics.ALL)
    finally:
        await bus.stop()
    await start_groups_at_end(
        bootstrap, {namespace + g: tuple(namespace + t for t in topics) for g, topics in groups.items()}
    )


def run_groups(run_id: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The settings naming this run's consumer groups, and each group's topics."""
    from temper.events import Topics

    g = {
        "TEMPER_DISPATCHER__RESULTS_GROUP": (f"dispatcher.{run_id}",
                                             (Topics.INFERENCE_RESULTS, Topics.SANDBOX_RESULTS, Topics.REWARD_RESULTS)),
        "TEMPER_DISPATCHER__POLICY_GROUP": (f"dispatcher-policy.{run_id}", (Topics.POLICY_UPDATES,)),
        "TEMPER_INFERENCE__REQUESTS_GROUP": (f"inference-gateway.{run_id}", (Topics.INFERENCE_REQUESTS,)),
        "TEMPER_INFERENCE__POLICY_GROUP": (f"inference-gateway-policy.{run_id}", (Topics.POLICY_UPDATES,)),
        "TEMPER_SANDBOX__GROUP": (f"sandbox-worker.{run_id}", (Topics.SANDBOX_REQUESTS,)),
        "TEMPER_REWARD_SCORER__GROUP": (f"reward-scorer.{run_id}", (Topics.REWARD_REQUESTS,)),
        "TEMPER_TRAINER__GROUP": (f"trainer.{run_id}", (Topics.TRAJECTORIES,)),
    }  # fmt: skip
    return {k: name for k, (name, _) in g.items()}, {name: topics for name, topics in g.values()}


def sandbox_root(run_dir: Path, run_id: str) -> Path:
    """Where the sandboxes' workspaces go: the run directory if the sandbox uid can reach
    it (every directory above it searchable by others), else a directory in /tmp."""
    if all(os.stat(p).st_mode & 0o001 for p in run_dir.parents):
        return run_dir / "sandboxes"
    return Path(tempfile.gettempdir()) / f"temper-sandboxes-{run_id}"
