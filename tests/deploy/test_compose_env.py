"""Every Temper service starts with the exact environment docker-compose.yml gives it and
answers /health: the compose host names point at this machine's stack, each service
listens on a free port. Two changes keep the run private on the shared stack: a fresh
database, and consumer groups of their own (the compose groups would share partitions
with whatever else consumes on the same broker)."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from services.launcher.resources import free_port, fresh_database, run_groups, stack_env

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.kafka,
    pytest.mark.s3,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]
ROOT = Path(__file__).resolve().parents[2]


def compose_services() -> dict[str, dict]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {
        name: svc
        for name, svc in doc["services"].items()
        if svc.get("command", [None, None, None])[:2] == ["python", "-m"]
        and str(svc["command"][2]).startswith("services.")
    }


def substitute(value: str, variables: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in variables:
            return variables[name]
        if op == ":-":
            return arg
        raise KeyError(f"compose needs {name}: {arg}")

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)


def healthy(
    svc: dict, port: int, proc: subprocess.Popen[bytes], env: dict[str, str], http: httpx.Client
) -> bool:
    """The service's own compose health check: ``/health`` over HTTP for the services with
    one, else its CMD-SHELL test (the Celery worker and beat) run here with compose's
    ``$$`` unescaped, this host's name and the environment's ``celery`` on the path."""
    test = svc["healthcheck"]["test"]
    if test[0] == "CMD" and any("/health" in part for part in test):
        try:
            return http.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False
    assert test[0] == "CMD-SHELL", f"an unknown kind of health check: {test}"
    shell_env = {
        **env,
        "HOSTNAME": socket.gethostname(),
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
    }
    check = subprocess.run(
        ["sh", "-c", test[1].replace("$$", "$")], env=shell_env, capture_output=True, timeout=30
    )
    return check.returncode == 0


def test_every_service_answers_health_with_the_compose_environment(tmp_path):
    stack = stack_env()
    db_url = stack["TEMPER_DB__URL"]
    user_pw = re.match(r".*://([^:]+):([^@]+)@", db_url)
    assert user_pw, db_url
    variables = {
        "POSTGRES_PASSWORD": user_pw.group(2),
        "MINIO_ROOT_USER": stack.get("TEMPER_STORAGE__ACCESS_KEY", "temper"),
        "MINIO_ROOT_PASSWORD": stack.get("TEMPER_STORAGE__SECRET_KEY", "temper-secret-key"),
        "TEMPER_BOOTSTRAP_KEY": "tmp_" + secrets.token_urlsafe(30),
    }
    services = compose_services()
    assert {
        "dispatcher",
        "inference-gateway",
        "cpu-server",
        "sandbox-worker",
        "reward-scorer",
        "trainer",
    } <= set(services)
    ports = {name: free_port() for name in services}
    db_host = db_url.split("@", 1)[1].split("/", 1)[0]
    hosts = {
        "postgres:5432": db_host,
        "kafka:9092": stack["TEMPER_BUS__BOOTSTRAP"],
        "minio:9000": stack["TEMPER_STORAGE__ENDPOINT"],
        "redis:6379": stack.get("TEMPER_REDIS__URL", "redis://127.0.0.1:56379/0")
        .split("//", 1)[1]
        .split("/")[0],
        **{f"{name}:{port}": f"127.0.0.1:{ports[name]}" for name in services for port in (8000, 8001, 8010)},
    }
    run_id = uuid.uuid4().hex[:8]
    db_name = f"compose_{run_id}"
    fresh = fresh_database(db_url, db_name)
    from temper.db.migrate import upgrade

    upgrade(fresh)
    group_env, _ = run_groups(f"compose-{run_id}")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env_of: dict[str, dict[str, str]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in services}
    try:
        for name, svc in services.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
            for key, value in svc["environment"].items():
                text = substitute(str(value), variables)
                for host, here in hosts.items():
                    text = text.replace(host, here)
                env[key] = text
            assert env["TEMPER_MODE"] == "distributed"
            env.update(
                group_env,
                TEMPER_PORT=str(ports[name]),
                TEMPER_DB__URL=env["TEMPER_DB__URL"].rsplit("/", 1)[0] + f"/{db_name}",
            )
            env["TEMPER_DATA_DIR"] = str(tmp_path / name)
            env["PYTHONPATH"] = f"{ROOT / 'libs'}:{ROOT}"
            env_of[name] = env
            with logs[name].open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, *svc["command"][1:]],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        pending = set(services)
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=3) as http:
            while pending and time.monotonic() < deadline:
                for name in sorted(pending):
                    proc = procs[name]
                    assert proc.poll() is None, (
                        f"{name} exited {proc.returncode}:\n{logs[name].read_text()[-3000:]}"
                    )
                    if healthy(services[name], ports[name], procs[name], env_of[name], http):
                        pending.discard(name)
                time.sleep(1)
        assert not pending, {n: logs[n].read_text()[-1500:] for n in pending}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()  # a killed process not waited for warns when collected (a test error)
        import asyncio

        from services.launcher.resources import admin_sql

        asyncio.run(admin_sql(db_url, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
