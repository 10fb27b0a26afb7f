"""``python -m services.launcher SPEC``: the ``temper run`` job on the real stack.

The same spec and ``local:`` block as ``temper run``, but every service is its own
process (``python -m services.<name>``) talking through the real Kafka, Postgres and S3
that ``make stack-up`` started (addresses from the environment or ``.stack/env``):

1. a fresh database on the stack's Postgres (``--database-url`` to give one), migrated;
2. the policy created and warm-started as the ``local:`` block says (the embedded
   runner's code), saved in ``runs/<run-id>/policy-v0`` and uploaded to S3; the job's
   ``policy.init`` is that object key, which the trainer reads, and the gateway's local
   backend serves the run directory's copy;
3. consumer groups of this run (``<service>.<run-id>``) set to the end of the shared
   topics, so nothing an earlier run or a test left there is replayed;
4. the five services started with the stack's settings, logs in
   ``runs/<run-id>/<service>.log``, each waited for on ``/health``;
5. the task set uploaded and the job submitted over REST with the bootstrap key, its
   progress drawn until it ends;
6. the report (``summary.json``, ``reward_curve.png``, ``report.html``) written from
   Postgres and S3, as ``temper run`` writes it;
7. every process stopped (SIGTERM, then SIGKILL), on success, error or Ctrl-C.

Exit status 0 only if the job completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx

from services.embedded import localrun
from services.embedded.engine_process import EngineProcess
from services.launcher.resources import (
    ROOT,
    StackError,
    apply_overrides,
    free_port,
    fresh_database,
    groups_start_at_end,
    port_free,
    run_groups,
    sandbox_root,
    stack_env,
    storage_settings,
    upload_files,
)
from temper import cores
from temper.client import ApiError, TemperClient
from temper.jobspec import JobSpec, SpecError
from temper.tenants import new_key

# Started in this order (executors before the dispatcher that feeds them), stopped in reverse.
SERVICES = (
    ("sandbox_worker", 8002),
    ("inference_gateway", 8001),
    ("reward_scorer", 8003),
    ("trainer", 8004),
    ("dispatcher", 8000),
)


# --- the processes ----------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, chars: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Stack:
    """The five service processes of one run."""

    services: list[Service] = field(default_factory=list)

    def start(self, env: dict[str, str]) -> None:
        for svc in self.services:
            with svc.log_path.open("ab") as log:  # the child keeps its own descriptor
                svc.proc = subprocess.Popen(
                    [sys.executable, "-m", f"services.{svc.name}"],
                    cwd=ROOT,
                    env={**env, "TEMPER_PORT": str(svc.port), "TEMPER_HOST": "127.0.0.1"},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
                )

    def check_alive(self) -> None:
        for svc in self.services:
            if svc.proc is not None and svc.proc.poll() is not None:
                raise StackError(
                    f"{svc.name} exited with status {svc.proc.returncode}; its log ({svc.log_path}) ends:\n{svc.tail()}"
                )

    def wait_healthy(self, timeout_s: float, out: TextIO) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.services)
        last: dict[str, str] = {}
        with httpx.Client(timeout=3) as http:
            while pending:
                self.check_alive()
                for svc in list(pending):
                    try:
                        r = http.get(f"{svc.url}/health")
                        last[svc.name] = r.text[:300]
                        if r.status_code == 200:
                            pending.remove(svc)
                            out.write(f"  {svc.name} up on {svc.url}\n")
                    except httpx.HTTPError as exc:
                        last[svc.name] = str(exc)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(f"{s.name} ({last.get(s.name, 'no answer')})" for s in pending)
                    raise StackError(f"not healthy after {timeout_s:.0f}s: {names}")
                if pending:
                    time.sleep(0.5)
        out.flush()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM in reverse start order, then SIGKILL whatever is still running."""
        running = [s for s in reversed(self.services) if s.proc is not None and s.proc.poll() is None]
        for svc in running:
            assert svc.proc is not None
            with contextlib.suppress(ProcessLookupError):
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for svc in running:
            assert svc.proc is not None
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    svc.proc.kill()
                svc.proc.wait(timeout=10)


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class StackResult:
    run_dir: Path
    job_id: str
    state: str
    summary: dict[str, Any]
    database_url: str


def _terminate_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass
class Running:
    """The services of one run, up: the client (bootstrap key), the spec pinned to the
    uploaded task set and policy, the database, the processes."""

    run_dir: Path
    database_url: str
    spec: JobSpec
    api: TemperClient
    stack: Stack
    progress: Any
    started: float
    env: dict[str, str]


@contextlib.contextmanager
def running(args: argparse.Namespace, out: TextIO = sys.stderr) -> Iterator[Running]:
    """Steps 1-5 up to the submission: the database, the policy, the services healthy, the
    task set uploaded; on leaving, every process stopped (step 7). More than one job may
    be submitted while inside (tests/integration/test_sft_then_rl.py)."""
    from services.embedded.runner import Progress, make_policy

    spec_path = Path(args.spec)
    spec, local = localrun.load(spec_path)
    spec, local = apply_overrides(spec, local, args)
    env_stack = stack_env()
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    run_dir = (Path(args.runs_dir) / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    shutil.copy(spec_path, run_dir / "spec.yaml")
    out.write(f"temper run-stack: {spec.name} -> {run_dir}\n")

    db_name = "run_" + run_id.replace("-", "_").lower()
    database_url = args.database_url or fresh_database(env_stack["TEMPER_DB__URL"], db_name)
    from temper.db.migrate import upgrade

    upgrade(database_url)
    out.write(f"database: {database_url.split('@', 1)[-1]} (migrated)\n")

    started = time.perf_counter()
    progress = Progress(out)
    spec = make_policy(spec, local, run_dir, progress)
    policy_dir = Path(spec.policy.init or "")
    policy_key = f"runs/{run_id}/policy-v0"
    files = {p.name: p.read_bytes() for p in sorted(policy_dir.iterdir()) if p.is_file()}
    asyncio.run(upload_files(env_stack, files, policy_key))
    # init: the copy in object storage (the trainer's); model: the directory here, so the
    # dispatcher reads the policy's own tokenizer and the local backend serves it
    spec = spec.model_copy(
        update={"policy": spec.policy.model_copy(update={"init": policy_key, "model": str(policy_dir)})}
    )
    out.write(
        f"policy: {policy_dir} -> s3://{env_stack.get('TEMPER_STORAGE__BUCKET', 'temper')}/{policy_key}\n"
    )

    group_env, groups = run_groups(run_id)
    asyncio.run(groups_start_at_end(env_stack["TEMPER_BUS__BOOTSTRAP"], groups))

    key = new_key()
    workspaces = sandbox_root(run_dir, run_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    env.update(env_stack)
    env.update(group_env)
    batch = max(1, spec.schedule.max_concurrent_episodes)
    backends = [{"name": "local-0", "kind": "local", "model_dir": str(policy_dir), "max_batch": batch}]
    env.update(
        TEMPER_MODE="distributed",
        TEMPER_DB__URL=database_url,
        TEMPER_API__BOOTSTRAP_KEY=key,
        TEMPER_INFERENCE__BACKENDS=json.dumps(backends),
        TEMPER_INFERENCE__MODEL_NAME=spec.policy.model,
        TEMPER_INFERENCE__MAX_INFLIGHT_PER_BACKEND=str(batch),
        TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR=str(run_dir / "checkpoints"),
        TEMPER_DISPATCHER__SCHEDULER_INTERVAL_S="0.2",
        TEMPER_DATA_DIR=str(run_dir),
        TEMPER_SANDBOX__WORKSPACE_ROOT=str(workspaces),
        PYTHONUNBUFFERED="1",
    )
    if args.trainer_threads:
        env["TEMPER_TRAINER__THREADS"] = str(args.trainer_threads)
    engine = None
    if local.engine == "process":  # the engine a process of its own, beside the gateway's
        threads = args.trainer_threads or cores.half()
        engine = EngineProcess(
            run_dir, policy_dir, port=free_port(), max_batch=batch, threads=threads, env=env
        )
        out.write(f"engine: {engine.url} (log {engine.log_path})\n")
        engine.start()
        env["TEMPER_INFERENCE__BACKENDS"] = json.dumps(
            [{"name": "local-0", "kind": "cpu_server", "url": engine.url}]
        )

    stack = Stack()
    for name, default_port in SERVICES:
        port = default_port if not args.free_ports and port_free(default_port) else free_port()
        stack.services.append(Service(name, port, run_dir / f"{name}.log"))
    dispatcher = stack.services[-1]

    previous = signal.signal(signal.SIGTERM, _terminate_on_sigterm)
    api: TemperClient | None = None
    try:
        out.write("starting the services\n")
        stack.start(env)
        stack.wait_healthy(args.health_timeout, out)
        api = TemperClient(dispatcher.url, key, timeout=60)
        spec = _submit_taskset(api, spec, local)
        # the bootstrap tenant's quota must not cap the job's own concurrency
        quota = max(64, spec.schedule.max_concurrent_episodes)
        api._call("PATCH", "/v1/tenants/default", json={"max_concurrent_episodes": quota})
        yield Running(run_dir, database_url, spec, api, stack, progress, started, env_stack)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if api is not None:
            api.close()
        stack.stop()
        if engine is not None:
            engine.stop()
        if not str(workspaces).startswith(str(run_dir)):
            shutil.rmtree(workspaces, ignore_errors=True)


def run(args: argparse.Namespace, out: TextIO = sys.stderr) -> StackResult:
    job_id = ""
    state = "not submitted"
    with running(args, out) as r:
        try:
            job = r.api.submit(r.spec.model_dump(mode="json", exclude_none=True))
            job_id = job["id"]
            out.write(f"job {job_id} submitted to {r.stack.services[-1].url}\n")
            state = follow(r, job_id, timeout_s=args.timeout)
        except KeyboardInterrupt:
            out.write("\ninterrupted: cancelling the job and stopping the services\n")
            if job_id:
                with contextlib.suppress(ApiError, httpx.HTTPError):
                    r.api.cancel(job_id)
            raise
    summary = asyncio.run(_report(r.database_url, r.env, job_id, r.run_dir, time.perf_counter() - r.started))
    out.write(
        f"\n{state}: mean reward {summary['first_mean_reward']:.3f} (first iteration) -> "
        f"{summary['last_mean_reward']:.3f} (last), policy v{summary['policy_version']}, {summary['seconds']:.0f}s\n"
        f"report: {r.run_dir / 'report.html'}\nlogs: {r.run_dir}/<service>.log\n"
    )
    return StackResult(r.run_dir, job_id, state, summary, r.database_url)


def _submit_taskset(api: TemperClient, spec: JobSpec, local: localrun.LocalRun) -> JobSpec:
    """Upload the local task-set file; validation is not queued (no Celery worker here),
    and pending tasks are sampled as the embedded run samples them."""
    path = local.taskset_file
    kind = "application/yaml" if path.suffix in (".yaml", ".yml") else "application/x-ndjson"
    view = api._call("POST", "/v1/tasksets", params={"name": path.stem, "validate": "false"},
                     content=path.read_bytes(), headers={"Content-Type": kind})  # fmt: skip
    return spec.model_copy(update={"tasks": spec.tasks.model_copy(update={"taskset": view["id"]})})


def follow(r: Running, job_id: str, *, timeout_s: float) -> str:
    """Draw the job's progress until it ends; its final state."""
    from temper.cli.jobs import progress_lines
    from temper.lifecycle import JOB_TERMINAL

    api, progress = r.api, r.progress
    deadline = time.monotonic() + timeout_s
    while True:
        r.stack.check_alive()
        job = api.job(job_id)
        metrics = api.metrics(job_id)
        width = shutil.get_terminal_size((80, 20)).columns
        progress.show(progress_lines(job, metrics, color=progress.tty, width=width))
        if job["state"] in JOB_TERMINAL:
            progress.done()
            return str(job["state"])
        if time.monotonic() > deadline:
            progress.done()
            with contextlib.suppress(ApiError):
                api.cancel(job_id)
            raise StackError(f"job {job_id} did not end within {timeout_s:.0f}s (cancelled)")
        time.sleep(1.0)


async def _report(
    database_url: str, env: dict[str, str], job_id: str, run_dir: Path, seconds: float
) -> dict[str, Any]:
    from services.embedded.report import write_report
    from temper.db import Database, Job
    from temper.settings import DatabaseSettings
    from temper.storage import S3Store

    db = Database(DatabaseSettings(url=database_url))
    try:
        async with db.session() as session:
            job = await session.get(Job, job_id)
            if job is None:
                raise StackError(f"job {job_id} is not in {database_url}")
            return await write_report(session, S3Store(storage_settings(env)), job, run_dir, seconds=seconds)
    finally:
        await db.dispose()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.launcher",
        description="Run a temper-run spec on the real stack (Kafka, Postgres, S3), each service its own process.",
    )
    p.add_argument("spec", help="job spec with a local: block (as for temper run)")
    p.add_argument("--iterations", type=int, help="override schedule.iterations (a quicker run)")
    p.add_argument("--episodes", type=int, help="override schedule.episodes_per_iteration")
    p.add_argument("--group-size", type=int, help="override tasks.group_size")
    p.add_argument("--warm-start-steps", type=int, help="override local.warm_start.steps (0: no warm start)")
    p.add_argument("--database-url", help="a database to use (migrated here); default: a fresh one per run")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--run-id")
    p.add_argument("--free-ports", action="store_true", help="free ports instead of 8000-8004")
    p.add_argument(
        "--trainer-threads", type=int, default=0, help="torch threads of the trainer (0: torch's default)"
    )
    p.add_argument("--health-timeout", type=float, default=180.0)
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="cancel the job and fail after this many seconds"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except SpecError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except (StackError, ApiError) as exc:
        sys.stderr.write(f"run-stack failed: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0 if result.state == "completed" else 1
