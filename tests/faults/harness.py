"""Fault injection on the real stack, reusable by every recovery and chaos test.

A :class:`FaultStack` runs one small job with each service as its own process, started
the way ``make run-stack`` starts them (``python -m services.<name>``, the launcher's
settings, one consumer group per run), and lets a test break one part at a chosen
moment: SIGKILL or restart a service, stop a private object store or restart a private
Postgres (:class:`PrivateMinio`, :class:`PrivatePostgres`: the shared stack is never
touched), or dead-letter what waits on a topic. Afterwards it reads the truth back: the
database (:meth:`FaultStack.facts`, :meth:`FaultStack.assert_each_episode_scored_and_trained_once`)
and the topics (:meth:`FaultStack.commands`, every message of this job since the run began).

Everything is synchronous and polls (``wait_until``), so a test reads as a script:
start, wait for a moment, break something, wait for the job, check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from services.launcher import processes as launcher
from services.launcher import resources
from temper.client import TemperClient
from temper.db import SKIPPED_JOB_ENDED, SKIPPED_STALE, Episode, Job, PolicyVersion, Step, TrainedTrajectory
from temper.events import Topics
from temper.lifecycle import STEP_WAITING
from temper.tenants import new_key

ROOT = Path(__file__).resolve().parents[2]
TASKSET = ROOT / "examples" / "tasksets" / "arithmetic.jsonl"
CACHE_DIR = Path(os.environ.get("TEMPER_CACHE_DIR", Path.home() / ".cache" / "temper"))
PG_BIN = Path("/usr/lib/postgresql/15/bin")
# The commands a job sends, and what makes one command (a retry is another attempt).
COMMAND_TOPICS = {
    Topics.INFERENCE_REQUESTS: ("episode_id", "turn", "attempt"),
    Topics.SANDBOX_REQUESTS: ("episode_id", "turn", "attempt"),
    Topics.REWARD_REQUESTS: ("episode_id", "turn", "attempt"),
    Topics.TRAJECTORIES: ("episode_id",),
}


class FaultError(AssertionError):
    """The stack did not do what the test waited for; the message says what and shows logs."""


def wait_until(what: str, predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise FaultError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def small_spec(name: str, **overrides: Any) -> dict[str, Any]:
    """A job of single-turn arithmetic episodes on a tiny random policy: every group is
    trained (``skip_zero_variance`` off), each iteration's two groups are one step and one
    version, and ``max_staleness: 1`` lets the next iteration start on the version before.
    Without faults no trajectory is too stale to train on; a fault that delays one group
    past a step of the next iteration's groups can make it so (see ``allow_stale``)."""
    spec: dict[str, Any] = {
        "name": name,
        "policy": {"model": "temper-tiny", "sampling": {"temperature": 1.0, "max_tokens": 12}},
        "tasks": {"taskset": "local", "group_size": 4, "curriculum": "uniform"},
        "environment": {"kind": "math", "max_turns": 1, "system_prompt": ""},
        "rewards": {"answer_match": 1.0},
        "algorithm": {
            "learning_rate": 0.001,
            "groups_per_step": 2,
            "checkpoint_every": 1,
            "skip_zero_variance": False,
        },
        "schedule": {
            "iterations": 3,
            "episodes_per_iteration": 8,
            "max_concurrent_episodes": 8,
            "max_staleness": 1,
        },
    }
    for path, value in overrides.items():  # "schedule.max_staleness": 0
        node = spec
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return spec


def free_port() -> int:
    return resources.free_port()


# --- private servers: broken and restored by tests, never the shared ones --------------------------


class PrivatePostgres:
    """A Postgres cluster of its own (Debian's initdb/pg_ctl) on a free port, trust auth."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="temper-fault-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.url = f"postgresql+asyncpg://temper@127.0.0.1:{self.port}/temper"
        self._as_postgres = os.geteuid() == 0  # Postgres refuses to run as root

    def _run(self, *args: str) -> None:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(
            cmd, check=True, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=120
        )

    def start(self) -> PrivatePostgres:
        if self._as_postgres:
            shutil.chown(self.dir, "postgres")
        if not self.data.exists():
            self._run(
                "initdb", "-D", str(self.data), "-U", "temper", "-A", "trust", "-E", "UTF8", "--no-locale"
            )
            with (self.data / "postgresql.conf").open("a") as conf:
                conf.write(
                    f"listen_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.dir}'\n"
                    "max_connections = 200\nfsync = off\nsynchronous_commit = off\ntimezone = 'UTC'\n"
                )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-s", "start")
        asyncio.run(
            _admin(self.url.rsplit("/", 1)[0] + "/postgres", "CREATE DATABASE temper", ignore_exists=True)
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast`` disconnects every client (what a restart or failover does to them)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-s", "stop")

    def restart(self, down_s: float = 0.0) -> float:
        """Stop, stay down ``down_s``, start again; returns the seconds it was down."""
        t0 = time.monotonic()
        self.stop()
        time.sleep(down_s)
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-s", "start")
        return time.monotonic() - t0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateMinio:
    """A MinIO server of its own (the binary ``make stack-up`` built) on a free port."""

    ACCESS_KEY, SECRET_KEY, BUCKET = "temper", "temper-secret-key", "temper"

    def __init__(self) -> None:
        found = sorted((CACHE_DIR / "bin").glob("minio-*"))
        if not found:
            raise FaultError(f"no MinIO binary under {CACHE_DIR}/bin: run `make stack-up` first")
        self.binary = found[-1]
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="temper-fault-s3-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = f"127.0.0.1:{self.port}"

    def start(self) -> PrivateMinio:
        env = {
            **os.environ,
            "MINIO_ROOT_USER": self.ACCESS_KEY,
            "MINIO_ROOT_PASSWORD": self.SECRET_KEY,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "MINIO_CI_CD": "1",
        }
        with (self.dir / "minio.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "server", "--quiet", "--address", self.endpoint,
                 "--console-address", f"127.0.0.1:{free_port()}", str(self.dir / "data")],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        wait_until("MinIO to answer", lambda: _http_ok(f"http://{self.endpoint}/minio/health/live"), 60)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def settings(self) -> dict[str, str]:
        return {
            "TEMPER_STORAGE__ENDPOINT": self.endpoint,
            "TEMPER_STORAGE__ACCESS_KEY": self.ACCESS_KEY,
            "TEMPER_STORAGE__SECRET_KEY": self.SECRET_KEY,
            "TEMPER_STORAGE__BUCKET": self.BUCKET,
        }

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateKafka:
    """A single-node KRaft broker of its own (the jars ``make stack-up`` fetched) on free
    ports, configured as scripts/stack/up.sh configures the shared one; it keeps its log
    directory across :meth:`stop` and :meth:`start`, as a restarted broker does."""

    def __init__(self) -> None:
        found = sorted((CACHE_DIR / "kafka").glob("*/libs"))
        if not found:
            raise FaultError(f"no Kafka under {CACHE_DIR}/kafka: run `make stack-up` first")
        self.classpath = f"{found[-1]}/*"
        self.port, self.controller_port = free_port(), free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="temper-fault-kafka-"))
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        shared = (ROOT / "scripts" / "stack" / "up.sh").read_text()
        body = shared.split("write_kafka_config() {", 1)[1].split("<<EOF\n", 1)[1].split("\nEOF", 1)[0]
        for var, value in {
            "$HOST": "127.0.0.1",
            "$KAFKA_PORT": str(self.port),
            "$KAFKA_CONTROLLER_PORT": str(self.controller_port),
            "$KAFKA_DIR": str(self.dir),
        }.items():
            body = body.replace(var, value)
        (self.dir / "server.properties").write_text(body + "\n")
        log4j = ROOT / "scripts" / "stack" / "kafka" / "log4j2-quiet.properties"
        self.jvm = ["java", f"-Dlog4j2.configurationFile={log4j}", "-cp", self.classpath]
        subprocess.run(
            [*self.jvm[:1], "-Xmx128m", *self.jvm[1:], "kafka.tools.StorageTool", "format",
             "--ignore-formatted", "-t", uuid.uuid4().hex[:22], "-c", str(self.dir / "server.properties")],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=180,
        )  # fmt: skip

    def start(self, timeout_s: float = 180) -> PrivateKafka:
        with (self.dir / "kafka.out").open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.jvm[:1], "-Xms128m", "-Xmx384m", "-XX:+UseG1GC", f"-Dkafka.logs.dir={self.dir}",
                 *self.jvm[1:], "kafka.Kafka", str(self.dir / "server.properties")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        wait_until("the private Kafka broker to answer", self._answers, timeout_s, every_s=1.0)
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise FaultError(f"Kafka exited with {self.proc.returncode}; see {self.dir}/kafka.out")

        async def probe() -> bool:
            from aiokafka.admin import AIOKafkaAdminClient

            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000)
            try:
                await admin.start()
                await admin.list_topics()
                return True
            except Exception:
                return False
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()

        return asyncio.run(probe())

    def stop(self) -> None:
        """SIGKILL: the broker dies as a crashed one does (no controlled shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Tripwire:
    """A TCP proxy in front of a server that calls ``on_trip`` (once, when armed) the first
    time a client chunk starts with a request matching ``pattern``, and drops that
    connection: "the object store went down just as the trainer uploaded a checkpoint"."""

    # What a refusing object store answers: S3's "slow down", which clients retry.
    _BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code></Error>'
    REFUSAL = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BODY), _BODY)
    )

    def __init__(
        self, target_port: int, pattern: bytes, on_trip: Callable[[], None], *, drop: bool = True
    ) -> None:
        """``drop=False`` forwards the matching request after ``on_trip`` (a moment to act
        on, not a fault of its own)."""
        self.target_port = target_port
        self.pattern = re.compile(pattern)
        self.on_trip = on_trip
        self.drop = drop
        self.refusing_until = 0.0
        self.armed = False
        self.tripped_at: float | None = None
        self.port = free_port()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def refuse(self, seconds: float) -> None:
        """Answer every request with 503 for ``seconds`` (an object store that is up but
        refuses work), on new and open connections alike."""
        self.refusing_until = time.monotonic() + seconds

    def _refusing(self) -> bool:
        return time.monotonic() < self.refusing_until

    def _serve(self, client: socket.socket) -> None:
        if self._refusing():
            with contextlib.suppress(OSError):
                client.recv(65536)
                client.sendall(self.REFUSAL)
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            client.close()  # the server is down: so is the proxy, for this client
            return
        upstream.settimeout(None)

        def pump_back() -> None:
            with contextlib.suppress(OSError):
                while data := upstream.recv(65536):
                    client.sendall(data)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)

        threading.Thread(target=pump_back, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self._refusing():
                    client.sendall(self.REFUSAL)
                    break
                if self.armed and self.tripped_at is None and self.pattern.match(data):
                    self.tripped_at = time.monotonic()
                    self.on_trip()
                    if self.drop:
                        break
                upstream.sendall(data)
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop = True
        self._server.close()


# --- the stack of one run -----------------------------------------------------------------------------


@dataclass
class Facts:
    job: Job
    episodes: list[Episode]
    rewards_done: dict[str, int]  # episode -> finished reward steps
    ledger: dict[str, TrainedTrajectory]
    versions: list[int]
    inference: list[Step]  # finished inference steps, with their results
    # Samples each published version's step trained on (its metrics): a trajectory trained
    # twice shows as more samples than trajectories.
    version_samples: dict[int, int] = field(default_factory=dict)
    sandbox: list[Step] = field(default_factory=list)  # finished sandbox steps, with their results
    scored: list[Step] = field(default_factory=list)  # finished reward steps
    published_at: dict[int, datetime] = field(default_factory=dict)  # version -> its row's time
    leased: int = 0  # steps whose command is out and whose result is awaited

    def by_state(self) -> Counter[str]:
        return Counter(e.state for e in self.episodes)


@dataclass
class FaultStack:
    """One small job on the stack, each service its own process. ``db_url`` and
    ``storage`` replace the shared Postgres and object store (private servers the test
    may break); Kafka is the shared broker (or ``bootstrap``'s), and the run's topics and
    groups are its own: the bus namespace ``<run_id>.`` is put in front of every name, as a
    deployment sharing a cluster does, so runs at the same time never read each other's
    messages. The run's topics are deleted at :meth:`stop`."""

    workdir: Path
    spec: dict[str, Any]
    db_url: str | None = None
    storage: dict[str, str] | None = None
    bootstrap: str | None = None  # a private Kafka broker instead of the shared one
    env_overrides: dict[str, str] = field(default_factory=dict)
    # A model directory to serve and start from (default: a tiny random policy), on how many
    # CPU engines inside the gateway, and the TEMPER_FAULTS directory of every service
    # (temper.faults: the fault points a test can arm).
    policy_source: Path | None = None
    engines: int = 1
    faults_dir: Path | None = None
    services: dict[str, launcher.Service] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: "fault-" + uuid.uuid4().hex[:8])

    SERVICE_NAMES = tuple(name for name, _ in launcher.SERVICES)

    def __post_init__(self) -> None:
        self.stack_env = resources.stack_env()
        if self.storage:
            self.stack_env.update(self.storage)
        if self.bootstrap:
            self.stack_env["TEMPER_BUS__BOOTSTRAP"] = self.bootstrap
        self.ns = f"{self.run_id}."
        self.stack_env["TEMPER_BUS__NAMESPACE"] = self.ns
        self.run_dir = self.workdir / self.run_id
        self.run_dir.mkdir(parents=True)
        self.key = new_key()
        self.job_id = ""
        self.api: TemperClient | None = None
        self.offsets: dict[str, dict[int, int]] = {}
        self.database_url = ""
        self.tasksets: dict[str, str] = {}  # name -> id, uploaded once

    # --- setting up ---------------------------------------------------------------------
    def prepare(self) -> FaultStack:
        """A fresh migrated database, the policy v0 in the object store, the topics' start
        offsets (to count this run's messages), and this run's groups at the topics' end."""
        from temper.db.migrate import upgrade
        from temper.policy import create_model, save_checkpoint

        base = self.db_url or self.stack_env["TEMPER_DB__URL"]
        name = "fault_" + self.run_id.replace("-", "_")
        self.database_url = resources.fresh_database(base, name)
        upgrade(self.database_url)
        policy_dir = self.policy_source or self.run_dir / "policy-v0"
        if self.policy_source is None:
            save_checkpoint(
                create_model("tiny", seed=0), policy_dir, metadata={"version": 0, "preset": "tiny"}
            )
        policy_key = f"runs/{self.run_id}/policy-v0"
        files = {p.name: p.read_bytes() for p in sorted(policy_dir.iterdir()) if p.is_file()}
        asyncio.run(resources.upload_files(self.stack_env, files, policy_key))
        self.spec["policy"]["init"] = policy_key
        self.policy_dir = policy_dir
        bootstrap = self.stack_env["TEMPER_BUS__BOOTSTRAP"]
        self.group_env, groups = resources.run_groups(self.run_id)
        asyncio.run(resources.groups_start_at_end(bootstrap, groups, self.ns))  # creates the topics too
        watched = [*Topics.ALL, *(Topics.dead_letter(t) for t in Topics.ALL)]
        self.offsets = asyncio.run(_end_offsets(bootstrap, watched, self.ns))
        self.groups = groups
        return self

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
        env.update(self.stack_env)
        env.update(self.group_env)
        batch = self.spec["schedule"]["max_concurrent_episodes"]
        backends = [
            {"name": f"local-{i}", "kind": "local", "model_dir": str(self.policy_dir), "max_batch": batch}
            for i in range(self.engines)
        ]
        env.update(
            TEMPER_MODE="distributed",
            TEMPER_DB__URL=self.database_url,
            TEMPER_API__BOOTSTRAP_KEY=self.key,
            TEMPER_INFERENCE__BACKENDS=json.dumps(backends),
            TEMPER_INFERENCE__MODEL_NAME=self.spec["policy"]["model"],
            TEMPER_INFERENCE__MAX_INFLIGHT_PER_BACKEND=str(batch),
            TEMPER_INFERENCE__CHECKPOINT_CACHE_DIR=str(self.run_dir / "checkpoints"),
            TEMPER_DISPATCHER__SCHEDULER_INTERVAL_S="0.2",
            TEMPER_TRAINER__THREADS="1",
            TEMPER_DATA_DIR=str(self.run_dir),
            TEMPER_SANDBOX__WORKSPACE_ROOT=str(
                Path(tempfile.gettempdir()) / f"temper-sandboxes-{self.run_id}"
            ),
            PYTHONUNBUFFERED="1",
        )
        if self.faults_dir is not None:
            env["TEMPER_FAULTS"] = str(self.faults_dir)
        env.update(self.env_overrides)
        return env

    def start(self, names: list[str] | None = None, timeout_s: float = 120) -> FaultStack:
        """Start services (default: all five, in the launcher's order) and wait for /health."""
        names = names or [n for n, _ in launcher.SERVICES]
        for name in names:
            self.start_service(name)
        for name in names:
            self.wait_healthy(name, timeout_s)
        return self

    def start_service(self, name: str, module: str | None = None) -> None:
        """Start ``services.<module or name>`` as the process called ``name`` (a second
        replica of a service: ``start_service("dispatcher-2", "dispatcher")``)."""
        svc = self.services.get(name)
        if svc is None:
            svc = self.services[name] = launcher.Service(name, free_port(), self.run_dir / f"{name}.log")
        if svc.proc is not None and svc.proc.poll() is None:
            raise FaultError(f"{name} is already running")
        with svc.log_path.open("ab") as log:
            svc.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{module or name}"],
                cwd=ROOT,
                env={**self.env(), "TEMPER_PORT": str(svc.port), "TEMPER_HOST": "127.0.0.1"},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def health(self, name: str) -> int | None:
        """The HTTP status of the service's /health, or None if it does not answer."""
        try:
            return httpx.get(f"{self.services[name].url}/health", timeout=3).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self, name: str, timeout_s: float = 120) -> None:
        def ok() -> bool:
            proc = self.services[name].proc
            if proc is not None and proc.poll() is not None:
                raise FaultError(f"{name} exited with {proc.returncode}:\n{self.services[name].tail()}")
            return self.health(name) == 200

        wait_until(f"{name} to be healthy", ok, timeout_s, every_s=0.5)

    def kill(self, name: str, sig: int = signal.SIGKILL, *, wait: bool = True) -> None:
        """Send ``sig`` to a service; ``wait=False`` for one that does not end it (SIGSTOP)."""
        proc = self.services[name].proc
        assert proc is not None
        proc.send_signal(sig)
        if wait:
            proc.wait(timeout=30)

    def submit(self, spec: dict[str, Any] | None = None, *, taskset: tuple[str, bytes] | None = None) -> str:
        """Submit ``spec`` (default: the stack's) on ``taskset`` (name, JSONL; default the
        arithmetic set), uploaded once per name; the job is the stack's ``job_id`` now."""
        dispatcher = self.services["dispatcher"]
        if self.api is None:
            self.api = TemperClient(dispatcher.url, self.key, timeout=60)
            self.api._call("PATCH", "/v1/tenants/default", json={"max_concurrent_episodes": 64})
        api = self.api
        name, data = taskset or ("arithmetic", TASKSET.read_bytes())
        if name not in self.tasksets:
            view = api._call("POST", "/v1/tasksets", params={"name": name, "validate": "false"},
                             content=data, headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
            self.tasksets[name] = view["id"]
        spec = spec if spec is not None else self.spec
        spec["tasks"]["taskset"] = self.tasksets[name]
        self.job_id = api.submit(spec)["id"]
        return self.job_id

    def stop(self) -> None:
        for name in reversed(list(self.services)):
            proc = self.services[name].proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for svc in self.services.values():
            if svc.proc is not None:
                try:
                    svc.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    svc.proc.kill()
                    svc.proc.wait(timeout=10)
        if self.api is not None:
            self.api.close()
        shutil.rmtree(Path(tempfile.gettempdir()) / f"temper-sandboxes-{self.run_id}", ignore_errors=True)
        with contextlib.suppress(Exception):  # a private broker may be gone already
            asyncio.run(_delete_topics(self.stack_env["TEMPER_BUS__BOOTSTRAP"], self.ns))
        if self.database_url and not self.db_url:  # the run's database on the shared Postgres
            name = self.database_url.rsplit("/", 1)[1]
            with contextlib.suppress(Exception):
                asyncio.run(
                    _admin(self.stack_env["TEMPER_DB__URL"], f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                )

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {n} ---\n{s.tail(chars)}" for n, s in self.services.items())

    def job_trace(self, job_id: str, lines: int = 12) -> str:
        """Why a job may have stopped: which of its versions the gateway confirmed serving
        (the staleness gate waits on that) and each service's last log lines naming it (the
        tails of :meth:`logs` are often all another job's)."""
        served = asyncio.run(_served(self.database_url, job_id))
        out = [f"--- job {job_id}: versions and who confirmed serving them: {served}"]
        for name, service in self.services.items():
            try:
                text = service.log_path.read_text(errors="replace")
            except OSError:
                continue
            mine = [line[:400] for line in text.splitlines() if job_id in line][-lines:]
            out.append(f"--- {name}, lines naming {job_id} ---\n" + "\n".join(mine))
        return "\n".join(out)

    # --- reading the truth back -------------------------------------------------------------
    def facts(self, job_id: str | None = None) -> Facts:
        """What the database says of this run's job (or of another job of the run)."""
        return asyncio.run(_facts(self.database_url, job_id or self.job_id))

    def group_lag(self, service_group_env: str, topic: str) -> int:
        """Messages of ``topic`` that the service's consumer group has not committed yet."""
        return asyncio.run(
            _group_lag(
                self.stack_env["TEMPER_BUS__BOOTSTRAP"],
                self.ns + self.group_env[service_group_env],
                self.ns + topic,
            )
        )

    def peak_rss_mb(self, name: str) -> float:
        """The service process's peak resident memory so far (the kernel's VmHWM)."""
        proc = self.services[name].proc
        assert proc is not None and proc.poll() is None, f"{name} is not running"
        status = Path(f"/proc/{proc.pid}/status").read_text()
        kb = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]
        return kb / 1024

    def job_state(self, job_id: str | None = None) -> str:
        return self.facts(job_id).job.state

    def wait(self, what: str, predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.3) -> Any:
        """:func:`wait_until`, failing with the job's progress and the services' logs."""
        try:
            return wait_until(what, predicate, timeout_s, every_s)
        except FaultError as exc:
            f = self.facts()
            raise FaultError(
                f"{exc}; job {f.job.state}, episodes {dict(f.by_state())}, versions {f.versions}, "
                f"reason {f.job.state_reason!r}\n{self.logs()}"
            ) from None

    def wait_job(self, timeout_s: float, job_id: str | None = None) -> Facts:
        """Until the job (default: the last submitted) is finished; raises with the services'
        logs if it is not in time."""
        job_id = job_id or self.job_id
        try:
            wait_until(f"job {job_id} to finish", lambda: self.job_state(job_id) in ("completed", "failed", "cancelled"),
                       timeout_s, every_s=0.5)  # fmt: skip
        except FaultError as exc:
            f = self.facts(job_id)
            raise FaultError(
                f"{exc}; episodes {dict(f.by_state())}, versions {f.versions}, "
                f"reason {f.job.state_reason!r}\n{self.job_trace(job_id)}\n{self.logs()}"
            ) from None
        if self.job_state(job_id) == "completed":
            self.settle(job_id=job_id)
        return self.facts(job_id)

    def settle(self, timeout_s: float = 45.0, *, job_id: str | None = None) -> None:
        """After a job completed, until the trainer has closed it (no ledger row left
        buffered: what could not make a step is marked ``job_ended``) and every outbox row is
        published (a row whose writer could not send it waits out its claim, 30 s). Returns
        at the timeout all the same: the checks that follow say what is missing."""

        def settled() -> bool:
            buffered = [r for r in self.facts(job_id).ledger.values() if r.step is None and not r.skipped]
            rows = asyncio.run(_outbox_rows(self.database_url))
            return not buffered and all(published for _, (_, published), _ in rows)

        try:
            wait_until(
                "the trainer to close the job and the outbox to drain", settled, timeout_s, every_s=0.5
            )
        except FaultError:
            pass

    def assert_each_episode_scored_and_trained_once(
        self, facts: Facts | None = None, *, allow_stale: bool = False, spec: dict[str, Any] | None = None
    ) -> Facts:
        """``allow_stale``: a trajectory the trainer dropped by the job's own staleness rule
        (ledger ``skipped: stale``) counts as handled, not lost. A fault that delays one group
        (a restarted scorer, say) while the next iteration's groups make a step can leave
        it more than ``max_staleness`` versions behind; it was still scored exactly once
        and its drop is recorded (and counted in ``temper_trainer_skipped_groups_total``).
        The drop can leave the job's last step a group short: that group is recorded
        ``skipped: job_ended`` when the job completes, and counts as handled too."""
        f = facts or self.facts()
        spec = spec or self.spec
        assert f.job.state == "completed", (f.job.state, f.job.state_reason)
        schedule = spec["schedule"]
        assert len(f.episodes) == schedule["iterations"] * schedule["episodes_per_iteration"]
        # A job can complete in the tick that sees its last step, before that tick marks the
        # episodes trained: the ledger below is what says they were.
        assert set(f.by_state()) <= {"scored", "trained"}, f.by_state()
        assert f.rewards_done == {e.id: 1 for e in f.episodes}, "each episode scored exactly once"
        assert set(f.ledger) == {e.id for e in f.episodes}, "each trajectory reached the trainer"
        allowed = {SKIPPED_STALE} if allow_stale else set()
        ended = [e for e, r in f.ledger.items() if r.skipped == SKIPPED_JOB_ENDED]
        if ended and allowed:
            # only what a stale drop can leave: less than one step's groups
            assert len(ended) < spec["algorithm"]["groups_per_step"] * spec["tasks"]["group_size"], (
                f"{len(ended)} trajectories left untrained at the job's end"
            )
            assert any(r.skipped == SKIPPED_STALE for r in f.ledger.values()), "left at the end, none stale"
            allowed.add(SKIPPED_JOB_ENDED)
        skipped = {
            e: r.skipped
            for e, r in f.ledger.items()
            if (r.skipped or r.step is None) and r.skipped not in allowed
        }
        assert not skipped, f"trajectories not trained on: {skipped}"
        return f

    def commands(self, job_id: str | None = None) -> dict[str, Counter[tuple[Any, ...]]]:
        """Every command message of this job (default: the last submitted) since
        :meth:`prepare`, counted per topic by its identity (episode, turn, attempt; the
        episode for a trajectory)."""
        offsets = {t: o for t, o in self.offsets.items() if t in COMMAND_TOPICS}
        return asyncio.run(
            _count_commands(self.stack_env["TEMPER_BUS__BOOTSTRAP"], offsets, job_id or self.job_id, self.ns)
        )

    def outbox_lost(self) -> list[str]:
        """Outbox rows of this run's database that never reached their topic: not marked
        published, or marked but absent from the topic since :meth:`prepare` (compared by
        payload). A row published twice is not lost; consumers drop the second copy."""
        rows = asyncio.run(_outbox_rows(self.database_url))
        topics = {topic for topic, _, _ in rows}
        unknown = topics - set(self.offsets)
        if unknown:
            raise FaultError(f"outbox rows for topics the harness does not watch: {sorted(unknown)}")
        records = asyncio.run(
            _read_range(
                self.stack_env["TEMPER_BUS__BOOTSTRAP"], {t: self.offsets[t] for t in topics}, self.ns
            )
        )
        seen = {(r.topic, bytes(r.value)) for r in records}
        return [
            f"outbox row {row_id} ({topic}): " + ("never published" if not published else "not on the topic")
            for topic, (row_id, published), payload in rows
            if not published or (topic, payload) not in seen
        ]

    def dead_letters(self, job_ids: Collection[str] = ()) -> Counter[str]:
        """This job's (or these jobs') messages on the dead-letter topics since :meth:`prepare`,
        per topic."""
        jobs = set(job_ids) or {self.job_id}
        dead = {Topics.dead_letter(t) for t in Topics.ALL}
        offsets = {t: o for t, o in self.offsets.items() if t in dead}
        records = asyncio.run(_read_range(self.stack_env["TEMPER_BUS__BOOTSTRAP"], offsets, self.ns))
        return Counter(r.topic for r in records if json.loads(r.value).get("job_id") in jobs)

    def dead_letter_waiting(self, service_group_env: str, topic: str) -> int:
        """Move what waits on ``topic`` for this run's group named by ``service_group_env``
        (a ``TEMPER_*_GROUP`` setting) to its dead-letter topic, as the bus does with a
        poison message, and commit the group past it. The service must be stopped."""
        group = self.group_env[service_group_env]
        return asyncio.run(
            _dead_letter_waiting(self.stack_env["TEMPER_BUS__BOOTSTRAP"], group, topic, self.job_id, self.ns)
        )


# --- helpers ---------------------------------------------------------------------------------


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _admin(url: str, sql: str, ignore_exists: bool = False) -> None:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(sql)
    except asyncpg.DuplicateDatabaseError:
        if not ignore_exists:
            raise
    finally:
        await conn.close()


async def _served(url: str, job_id: str) -> dict[int, list[str] | None]:
    from temper.db import Database
    from temper.settings import DatabaseSettings

    db = Database(DatabaseSettings(url=url))
    try:
        async with db.session() as s:
            rows = await s.execute(
                select(PolicyVersion.version, PolicyVersion.served_by).where(PolicyVersion.job_id == job_id)
            )
            return {int(v): by for v, by in rows}
    finally:
        await db.dispose()


async def _facts(url: str, job_id: str) -> Facts:
    from temper.db import Database
    from temper.settings import DatabaseSettings

    db = Database(DatabaseSettings(url=url))
    try:
        async with db.session() as s:
            job = await s.get(Job, job_id)
            assert job is not None, f"no job {job_id}"
            episodes = list((await s.execute(select(Episode).where(Episode.job_id == job_id))).scalars())
            rewards = dict(
                (
                    await s.execute(
                        select(Step.episode_id, func.count())
                        .join(Episode, Episode.id == Step.episode_id)
                        .where(Episode.job_id == job_id, Step.kind == "reward", Step.state == "done")
                        .group_by(Step.episode_id)
                    )
                ).all()
            )
            ledger = {
                r.episode_id: r
                for r in (
                    await s.execute(select(TrainedTrajectory).where(TrainedTrajectory.job_id == job_id))
                ).scalars()
            }
            published = (
                await s.execute(
                    select(PolicyVersion.version, PolicyVersion.metrics, PolicyVersion.created_at).where(
                        PolicyVersion.job_id == job_id
                    )
                )
            ).all()
            versions = sorted(v for v, _, _ in published)
            samples = {v: int((m or {}).get("samples", 0)) for v, m, _ in published}
            done = {
                kind: list(
                    (
                        await s.execute(
                            select(Step)
                            .join(Episode, Episode.id == Step.episode_id)
                            .where(Episode.job_id == job_id, Step.kind == kind, Step.state == "done")
                        )
                    ).scalars()
                )
                for kind in ("inference", "sandbox", "reward")
            }
            leased = await s.scalar(
                select(func.count())
                .select_from(Step)
                .join(Episode, Episode.id == Step.episode_id)
                .where(Episode.job_id == job_id, Step.state.in_([w.value for w in STEP_WAITING]))
            )
            return Facts(
                job, episodes, rewards, ledger, versions, done["inference"], samples,
                done["sandbox"], done["reward"], {v: at for v, _, at in published}, int(leased or 0),
            )  # fmt: skip
    finally:
        await db.dispose()


async def _outbox_rows(url: str) -> list[tuple[str, tuple[int, bool], bytes]]:
    from temper.db import Database, OutboxRow
    from temper.settings import DatabaseSettings

    db = Database(DatabaseSettings(url=url))
    try:
        async with db.session() as s:
            rows = await s.execute(
                select(OutboxRow.topic, OutboxRow.id, OutboxRow.published_at, OutboxRow.payload)
            )
            return [(t, (i, p is not None), bytes(payload)) for t, i, p, payload in rows.all()]
    finally:
        await db.dispose()


async def _end_offsets(bootstrap: str, topics: list[str], ns: str = "") -> dict[str, dict[int, int]]:
    """Each topic's end offset per partition, by its name without the namespace ``ns``."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        out: dict[str, dict[int, int]] = {}
        for topic in topics:
            name = ns + topic
            tps = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or ())]
            if not tps:
                await consumer._client.force_metadata_update()
                tps = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or ())]
            ends = await consumer.end_offsets(tps)
            out[topic] = {tp.partition: off for tp, off in ends.items()}
        return out
    finally:
        await consumer.stop()


@dataclass(frozen=True)
class _Record:
    topic: str  # without the namespace
    offset: int
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


async def _read_range(bootstrap: str, offsets: dict[str, dict[int, int]], ns: str = "") -> list[_Record]:
    """Every record of the topics (named without the namespace ``ns``) from the given start
    offsets to their current end; a partition with no start offset is read from 0."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    ends = await _end_offsets(bootstrap, list(offsets), ns)
    records: list[_Record] = []
    starts = {TopicPartition(ns + t, p): offsets[t].get(p, 0) for t, parts in ends.items() for p in parts}
    todo = {tp: ends[tp.topic.removeprefix(ns)][tp.partition] for tp in starts}
    todo = {tp: end for tp, end in todo.items() if end > starts[tp]}
    if not todo:
        return records
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(todo))
        for tp in todo:
            consumer.seek(tp, starts[tp])
        deadline = time.monotonic() + 60
        while todo and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            for tp, recs in batches.items():
                for r in recs:
                    if tp in todo and r.offset < todo[tp]:
                        topic = r.topic.removeprefix(ns)
                        records.append(_Record(topic, r.offset, r.key, r.value, tuple(r.headers)))
                if tp in todo and recs and recs[-1].offset + 1 >= todo[tp]:
                    del todo[tp]
        if todo:
            raise FaultError(f"could not read {sorted(map(str, todo))} to the end")
        return records
    finally:
        await consumer.stop()


async def _delete_topics(bootstrap: str, ns: str) -> None:
    """Delete every topic whose name starts with the run's namespace ``ns``."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        names = [t for t in await admin.list_topics() if t.startswith(ns)]
        if names:
            await admin.delete_topics(names)
    finally:
        await admin.close()


async def _count_commands(
    bootstrap: str, offsets: dict[str, dict[int, int]], job_id: str, ns: str = ""
) -> dict[str, Counter[tuple[Any, ...]]]:
    counts: dict[str, Counter[tuple[Any, ...]]] = {t: Counter() for t in offsets}
    for r in await _read_range(bootstrap, offsets, ns):
        doc = json.loads(r.value)
        if doc.get("job_id") == job_id:
            counts[r.topic][tuple(doc.get(k) for k in COMMAND_TOPICS[r.topic])] += 1
    return counts


async def _group_lag(bootstrap: str, group: str, topic: str) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            await consumer._client.force_metadata_update()
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        ends = await consumer.end_offsets(tps)
        lag = 0
        for tp in tps:
            lag += ends[tp] - ((await consumer.committed(tp)) or 0)
        return lag
    finally:
        await consumer.stop()


async def _dead_letter_waiting(bootstrap: str, group: str, topic: str, job_id: str, ns: str = "") -> int:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.structs import OffsetAndMetadata

    group, plain = ns + group, topic
    topic = ns + topic
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await consumer.start()
    await producer.start()
    moved = 0
    try:
        await consumer._client.force_metadata_update()
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        assert tps, f"no partitions of {topic}"
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = {tp: (await consumer.committed(tp)) or 0 for tp in tps}
        records = await _read_range(bootstrap, {plain: {tp.partition: starts[tp] for tp in tps}}, ns)
        for r in records:
            if json.loads(r.value).get("job_id") != job_id:
                continue
            headers = [*r.headers, ("temper.dlq.error", b"injected by the fault harness")]
            await producer.send_and_wait(ns + Topics.dead_letter(plain), r.value, key=r.key, headers=headers)
            moved += 1
        await consumer.commit({tp: OffsetAndMetadata(ends[tp], "") for tp in tps})
    finally:
        await producer.stop()
        await consumer.stop()
    return moved
