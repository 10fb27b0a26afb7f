"""`make compose-test`: the whole platform in containers, end to end.

docker-compose.yml (with deploy/compose/local-servers.yml, the servers built locally) runs
as its own compose project on free ports published on 127.0.0.1; this script waits for
every health check, creates a tenant and its key over REST, submits a small job, watches it
complete, reads its trajectories back from MinIO and its events through the example
analytics consumer, scrapes each service's /metrics, runs every Grafana panel's PromQL
against the compose Prometheus, then `docker-compose down -v`. It prints a summary and
exits 1 on any miss. Grafana itself is not run (it cannot be installed here): its panels'
queries are, against the same Prometheus it would read.

    .venv/bin/python scripts/compose/compose_test.py [--keep]   (after scripts/compose/build.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from deploy_e2e import Api, Summary, small_spec, wait_until  # noqa: E402 - the scripts folder above

PROJECT = "temper-compose-test"
FILES = ["-f", "docker-compose.yml", "-f", "deploy/compose/local-servers.yml"]
TASKSETS = ROOT / "examples" / "tasksets"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "temper.json"
# Published port variable -> the service whose container port it maps.
PORTS = {
    "DISPATCHER_PORT": "dispatcher",
    "GATEWAY_PORT": "inference-gateway",
    "SANDBOX_WORKER_PORT": "sandbox-worker",
    "REWARD_SCORER_PORT": "reward-scorer",
    "TRAINER_PORT": "trainer",
    "CPU_SERVER_PORT": "cpu-server",
    "PROMETHEUS_PORT": "prometheus",
    "MINIO_PORT": "minio",
    "MINIO_CONSOLE_PORT": "minio",
    "KAFKA_PORT": "kafka",
    "GRAFANA_PORT": "grafana",
}
# The services Prometheus scrapes (deploy/prometheus/prometheus.yml), by port variable.
SCRAPED = ["DISPATCHER_PORT", "GATEWAY_PORT", "SANDBOX_WORKER_PORT", "REWARD_SCORER_PORT", "TRAINER_PORT"]


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


# compose v2 (`docker compose`, or its binary) where given, else Debian's v1 `docker-compose`.
COMPOSE = os.environ.get("COMPOSE", "docker-compose").split()


def compose(
    env: dict[str, str], *args: str, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMPOSE, "-p", PROJECT, *FILES, *args], cwd=ROOT, env=env, text=True, check=check, **kw
    )


def containers(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each compose service's container state (status, exit code, health) by service name."""
    ids = compose(env, "ps", "-a", "-q", capture_output=True).stdout.split()
    if not ids:
        return {}
    out = subprocess.run(
        ["/usr/bin/docker", "inspect", *ids], capture_output=True, text=True, check=True
    ).stdout
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c["State"] for c in json.loads(out)}


def wait_healthy(env: dict[str, str], summary: Summary, timeout_s: float) -> bool:
    one_shots = {"migrate", "kafka-init", "minio-init"}
    last: dict[str, dict[str, Any]] = {}

    def settled() -> bool:
        nonlocal last
        last = containers(env)
        for name, state in last.items():
            if name in one_shots:
                if state["Status"] == "exited" and state["ExitCode"] != 0:
                    raise RuntimeError(f"{name} exited {state['ExitCode']}")
            elif state["Status"] != "running" and state.get("Restarting") is not True:
                raise RuntimeError(f"{name} is {state['Status']} (exit {state['ExitCode']})")
        return bool(last) and all(
            (s["Status"] == "exited" and s["ExitCode"] == 0)
            if n in one_shots
            else s.get("Health", {}).get("Status") == "healthy"
            for n, s in last.items()
        )

    t0 = time.monotonic()
    try:
        wait_until("every health check", settled, timeout_s, every_s=3)
    except (TimeoutError, RuntimeError) as exc:
        states = {n: s.get("Health", {}).get("Status", s["Status"]) for n, s in last.items()}
        summary.check(False, "every service healthy", f"{exc}; {states}")
        return False
    for name in sorted(last):
        how = "exited 0" if name in one_shots else "healthy"
        summary.check(True, f"service {name}", how)
    summary.check(True, "every service healthy", f"in {time.monotonic() - t0:.0f}s")
    return True


def run_job(env: dict[str, str], ports: dict[str, int], summary: Summary) -> str | None:
    """Tenant, key, taskset and job over REST; the job id once it completed."""
    api = Api(
        f"http://127.0.0.1:{ports['DISPATCHER_PORT']}", env["TEMPER_BOOTSTRAP_KEY"], "Compose Test", summary
    )
    taskset = api.upload_taskset(TASKSETS / "arithmetic.jsonl", "arithmetic")
    job_id = api.submit(small_spec(taskset, name="compose-test"))
    if api.wait_finished(job_id) is None:
        return None
    env["_TENANT"], env["_KEY"] = api.tenant, api.key
    return job_id


def check_trajectories(env: dict[str, str], ports: dict[str, int], job_id: str, summary: Summary) -> None:
    from minio import Minio

    client = Minio(
        f"127.0.0.1:{ports['MINIO_PORT']}", env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"], secure=False
    )
    prefix = f"tenants/{env['_TENANT']}/jobs/{job_id}/trajectories/"
    names = [o.object_name for o in client.list_objects("temper", prefix=prefix, recursive=True)]
    ok = len(names) >= 16
    if ok:
        doc = json.loads(client.get_object("temper", names[0]).read())
        ok = isinstance(doc, dict) and bool(doc)
    summary.check(ok, "trajectories in MinIO", f"{len(names)} objects under {prefix}")


def start_analytics(ports: dict[str, int], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    env.update(
        TEMPER_BUS__KIND="kafka",
        TEMPER_BUS__BOOTSTRAP=f"127.0.0.1:{ports['KAFKA_PORT']}",
        PYTHONPATH=f"{ROOT / 'libs'}:{ROOT}",
    )
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "examples/analytics_consumer.py",
                "--group",
                f"compose-test-{secrets.token_hex(4)}",
                "--every",
                "2",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def check_analytics(log: Path, job_id: str, summary: Summary) -> None:
    def seen() -> dict[str, Any] | None:
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        mine = [r for r in rows if r.get("job_id") == job_id]
        return mine[-1] if mine and mine[-1].get("state") == "completed" else None

    try:
        row = wait_until("the analytics consumer to see the job complete", seen, 60)
    except TimeoutError as exc:
        summary.check(False, "events via examples/analytics_consumer.py", f"{exc}: {log.read_text()[-600:]}")
        return
    summary.check(
        sum(row["episodes"].values()) >= 16,
        "events via examples/analytics_consumer.py",
        f"state {row['state']}, episodes {row['episodes']}, policy version {row['policy_version']}",
    )


def check_metrics(ports: dict[str, int], summary: Summary) -> None:
    """Each scraped service's /metrics on its published port; Prometheus has every target up."""
    with httpx.Client(timeout=10) as http:
        for var in SCRAPED:
            r = http.get(f"http://127.0.0.1:{ports[var]}/metrics")
            names = set(re.findall(r"^# TYPE (\w+)", r.text, re.M))
            temper = sorted(n for n in names if n.startswith("temper_"))
            summary.check(
                r.status_code == 200 and bool(temper),
                f"/metrics of {PORTS[var]}",
                f"{len(temper)} temper_* families",
            )
        prom = f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}/api/v1"
        targets = http.get(f"{prom}/targets").json()["data"]["activeTargets"]
        down = [t["labels"]["job"] for t in targets if t["health"] != "up"]
        summary.check(
            not down and len(targets) >= len(SCRAPED) + 1,
            "Prometheus scrapes every target",
            f"{len(targets)} targets, down: {down}",
        )
        for var in SCRAPED:
            job = f"temper-{PORTS[var]}"
            r = http.get(
                f"{prom}/query", params={"query": f'count({{job="{job}", __name__=~"temper_.*"}})'}
            ).json()
            n = int(float(r["data"]["result"][0]["value"][1])) if r["data"]["result"] else 0
            summary.check(n > 0, f"Prometheus has {job}'s series", f"{n} temper_* series")


def check_dashboard(ports: dict[str, int], summary: Summary) -> None:
    """Every panel's PromQL from the dashboard JSON, as Grafana would send it for the last 15
    minutes: $__rate_interval as 1m (four 15 s scrapes), $job as every job. Each must return a
    series: fault counters a clean run never increments export 0 from their service's start
    (temper.metrics.zero), so an empty panel is a miss."""
    prom = f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}/api/v1"
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("type") != "row"]
    with httpx.Client(timeout=20) as http:
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "1m").replace("$job", ".*")
                end = time.time()
                r = http.get(
                    f"{prom}/query_range", params={"query": expr, "start": end - 900, "end": end, "step": 15}
                ).json()
                if r.get("status") != "success":
                    summary.check(False, f"panel {panel['title']!r}", f"{expr}: {r.get('error')}")
                    continue
                series = len(r["data"]["result"])
                summary.check(series > 0, f"panel {panel['title']!r}", f"{series} series: {expr}")


def main() -> int:
    summary = Summary("compose-test")
    run(summary)
    summary.print()
    return 1 if summary.failed else 0


def run(summary: Summary) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the containers up (for debugging)")
    parser.add_argument("--health-timeout", type=float, default=420)
    args = parser.parse_args()
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")},
        **{k: str(v) for k, v in ports.items()},
        "BASE_IMAGE": "temper-base:bookworm",
        "TEMPER_BOOTSTRAP_KEY": "tmp_" + secrets.token_urlsafe(30),
        "POSTGRES_PASSWORD": secrets.token_urlsafe(12),
        "MINIO_ROOT_USER": "temper",
        "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(12),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(12),
    }
    version = subprocess.run([*COMPOSE, "version"], capture_output=True, text=True).stdout.strip()
    summary.check(
        bool(version), "compose", f"{COMPOSE[0]}: {version.splitlines()[0] if version else 'missing'}"
    )
    log_dir = ROOT / ".docker" / "compose-test"
    log_dir.mkdir(parents=True, exist_ok=True)
    analytics: subprocess.Popen[bytes] | None = None
    compose(
        env, "down", "-v", "--remove-orphans", check=False, capture_output=True
    )  # an earlier run's leftovers
    try:
        t0 = time.monotonic()
        up = compose(env, "up", "-d", "--no-build", capture_output=True, check=False)
        if not summary.check(up.returncode == 0, "docker-compose up -d", f"{time.monotonic() - t0:.0f}s"):
            print(up.stdout[-3000:], up.stderr[-3000:])
            return
        if not wait_healthy(env, summary, args.health_timeout):
            return
        analytics = start_analytics(ports, log_dir / "analytics.log")
        job_id = run_job(env, ports, summary)
        if job_id is None:
            return
        check_trajectories(env, ports, job_id, summary)
        check_analytics(log_dir / "analytics.log", job_id, summary)
        time.sleep(35)  # two more scrapes (15 s) after the job, so rates over 1m have points
        check_metrics(ports, summary)
        check_dashboard(ports, summary)
    except Exception as exc:  # a broken step is a miss, reported with the others
        summary.check(False, "compose-test ran to the end", f"{type(exc).__name__}: {exc}")
    finally:
        if analytics is not None:
            analytics.terminate()
            analytics.wait(timeout=20)
        if summary.failed:
            logs = compose(env, "logs", "--no-color", "--tail", "40", check=False, capture_output=True)
            (log_dir / "compose.log").write_text(logs.stdout + logs.stderr)
            print(f"[compose-test] container logs: {log_dir / 'compose.log'}")
        if not args.keep:
            t0 = time.monotonic()
            down = compose(env, "down", "-v", "--remove-orphans", check=False, capture_output=True)
            summary.check(down.returncode == 0, "docker-compose down -v", f"{time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
