"""`make k8s-test`: Temper on the one-node Kubernetes that `make k8s-up` runs, end to end.

1. Builds what the cluster runs (scripts/k8s/build.sh all; images.sh keda and temper) and
   installs the CRDs k8s/ uses, each from its operator's published source (crds.sh).
2. Sends every manifest of k8s/overlays/dev through the real API server (a server-side dry
   run): each must be accepted.
3. Installs KEDA from its own manifests (its Go module's config/default, with the images
   built here; its optional admission webhooks left out).
4. Applies k8s/overlays/local for real (dev, with Kafka and Postgres as plain StatefulSets),
   with Secrets made here, and waits for every workload to be ready with its probes passing.
5. Submits a small job over the dispatcher's Service; while it runs, deletes a sandbox
   worker pod and a gateway pod; checks the job completes with every episode finished once,
   its trajectories in the in-cluster MinIO and its events on the in-cluster Kafka.
6. A burst of sandbox work on sandbox.requests (sessions running a 2 s command each): KEDA
   must scale the sandbox workers up (new pods Ready and consuming) and back to one after.

Writes bench/results/k8s.json and prints a summary; exits 1 on any miss.

    .venv/bin/python scripts/k8s/k8s_test.py [--keep] [--skip-build] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from deploy_e2e import TASKSETS, Api, Summary, small_spec, wait_until  # noqa: E402 - the scripts folder above

SCRIPTS = ROOT / "scripts" / "k8s"
NS = "temper"
DRY_NS = "temper-dry-run"
RESULT = ROOT / "bench" / "results" / "k8s.json"


def common(*names: str) -> dict[str, str]:
    """Values from scripts/k8s/common.sh, the one place they are set."""
    script = f"source {SCRIPTS / 'common.sh'}; " + "; ".join(f'echo "${{{n}}}"' for n in names)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines(), strict=True))


ENV = common("K8S_BIN", "K8S_DIR", "K8S_VERSION", "KEDA_VERSION", "KEDA_IMAGE", "KEDA_ADAPTER_IMAGE")
KUBECONFIG = f"{ENV['K8S_DIR']}/admin.kubeconfig"


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = 300) -> str:
    proc = subprocess.run(
        [f"{ENV['K8S_BIN']}/kubectl", "--kubeconfig", KUBECONFIG, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args[:4])}: {proc.stderr.strip()[-1500:]}")
    return proc.stdout


def ok(*args: str) -> bool:
    """A kubectl command that succeeded (its output dropped)."""
    try:
        kubectl(*args)
    except RuntimeError:
        return False
    return True


def sh(*cmd: str, timeout: float = 3600) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout)


def step(summary: Summary, what: str, fn: Any, *args: Any) -> Any:
    t0 = time.monotonic()
    value = fn(*args)
    summary.check(True, what, f"{time.monotonic() - t0:.0f}s")
    return value


# --- 1-3: build, CRDs, the dev overlay through the API server, KEDA ---------------------
def build() -> None:
    sh("bash", str(SCRIPTS / "build.sh"), "all")
    sh("bash", str(SCRIPTS / "images.sh"), "keda")
    sh("bash", str(SCRIPTS / "images.sh"), "temper")


def install_crds() -> int:
    crds = subprocess.run(
        ["bash", str(SCRIPTS / "crds.sh")], capture_output=True, text=True, check=True
    ).stdout
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crds)
    # A CRD just created has no status for a moment: `kubectl wait` fails on it, so ask again.
    wait_until(
        "every CRD established",
        lambda: ok("wait", "--for", "condition=established", "crd", "--all", "--timeout", "10s"),
        120,
    )
    return crds.count("kind: CustomResourceDefinition")


def dry_run(summary: Summary, overlay: str = "k8s/overlays/dev") -> None:
    """Every document of an overlay through the API server's admission and validation,
    in a namespace of its own made for it (a dry run over live objects trips on immutable
    fields of Jobs, which says nothing about the manifests)."""
    work = Path(ENV["K8S_DIR"]) / "dry-run"
    work.mkdir(parents=True, exist_ok=True)
    source = os.path.relpath(ROOT / overlay, work)
    (work / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {DRY_NS}\nresources: [{source}]\n"
    )
    rendered = kubectl("kustomize", "--load-restrictor", "LoadRestrictionsNone", str(work))
    kubectl("delete", "namespace", DRY_NS, "--ignore-not-found", "--wait=true", timeout=320)
    kubectl("create", "namespace", DRY_NS)
    docs = [d for d in rendered.split("\n---\n") if d.strip()]
    proc = subprocess.run(
        [f"{ENV['K8S_BIN']}/kubectl", "--kubeconfig", KUBECONFIG, "apply", "--dry-run=server", "-f", "-"],
        input=rendered,
        capture_output=True,
        text=True,
    )
    kubectl("delete", "namespace", DRY_NS, "--wait=false")
    accepted = [line for line in proc.stdout.splitlines() if line.endswith("(server dry run)")]
    summary.check(
        proc.returncode == 0 and len(accepted) == len(docs),
        f"{overlay} accepted by the API server (server-side dry run)",
        f"{len(accepted)} of {len(docs)} documents"
        + (f"; {proc.stderr.strip()[:1500]}" if proc.returncode else ""),
    )


def install_keda() -> None:
    """KEDA's own config/default from its Go module, images swapped for the ones built here."""
    src = subprocess.run(
        ["go", "mod", "download", "-json", f"github.com/kedacore/keda/v2@{ENV['KEDA_VERSION']}"],
        cwd="/tmp",
        capture_output=True,
        text=True,
        check=True,
    )
    module = json.loads(src.stdout)["Dir"]
    overlay = Path(ENV["K8S_DIR"]) / "keda"
    overlay.mkdir(parents=True, exist_ok=True)
    keda_image, adapter_image = ENV["KEDA_IMAGE"].split(":"), ENV["KEDA_ADAPTER_IMAGE"].split(":")
    delete = "\n".join(
        f"  - patch: |-\n      $patch: delete\n      apiVersion: {api}\n      kind: {kind}\n      metadata: {{name: {name}{ns}}}"
        for api, kind, name, ns in [
            ("apps/v1", "Deployment", "keda-admission", ", namespace: keda"),
            ("v1", "Service", "keda-admission-webhooks", ", namespace: keda"),
            ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", "keda-admission", ""),
        ]
    )
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        # kustomize takes no absolute root: the module's directory, relative to this one
        f"resources:\n  - {os.path.relpath(Path(module) / 'config' / 'default', overlay)}\n"
        "images:\n"
        f"  - {{name: ghcr.io/kedacore/keda, newName: {keda_image[0]}, newTag: '{keda_image[1]}'}}\n"
        f"  - {{name: ghcr.io/kedacore/keda-metrics-apiserver, newName: {adapter_image[0]}, newTag: '{adapter_image[1]}'}}\n"
        f"patches:\n{delete}\n"
        # its manifests say Always, and there is no registry to pull from: the node has them
        "  - target: {kind: Deployment, namespace: keda}\n    patch: |-\n"
        "      - {op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: IfNotPresent}\n"
    )
    rendered = kubectl("kustomize", "--load-restrictor", "LoadRestrictionsNone", str(overlay))
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)
    for deploy in ("keda-operator", "keda-metrics-apiserver"):
        kubectl("-n", "keda", "rollout", "status", f"deploy/{deploy}", "--timeout", "300s", timeout=320)
    wait_until(
        "KEDA's external metrics API available",
        lambda: (
            "True"
            in kubectl(
                "get",
                "apiservice",
                "v1beta1.external.metrics.k8s.io",
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Available')].status}",
                check=False,
            )
        ),
        180,
    )


# --- 4: the local overlay ---------------------------------------------------------------
def make_secrets() -> str:
    """The Secrets k8s/base reads, made here before the overlay (never committed)."""
    if not kubectl("get", "namespace", NS, "--ignore-not-found", "-o", "name"):
        kubectl("create", "namespace", NS)
    bootstrap = "k8s_" + secrets.token_urlsafe(30)
    for name, data in {
        "temper-minio": {"access-key": "temper", "secret-key": secrets.token_urlsafe(18)},
        "temper-pg-app": {"username": "temper", "password": secrets.token_urlsafe(18)},
        "temper-api": {"bootstrap-key": bootstrap},
    }.items():
        doc = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": NS},
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }
        exists = kubectl("-n", NS, "get", "secret", name, "--ignore-not-found", "-o", "name")
        if not exists:
            kubectl("apply", "-f", "-", input=json.dumps(doc))
    raw = kubectl("-n", NS, "get", "secret", "temper-api", "-o", "jsonpath={.data.bootstrap-key}")
    return base64.b64decode(raw).decode()


def apply_local() -> None:
    rendered = kubectl("kustomize", str(ROOT / "k8s" / "overlays" / "local"))
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)


def not_ready() -> list[str]:
    """Workloads of the namespace not ready yet (operator-made pods included: every pod)."""
    pending: list[str] = []
    for kind in ("deployment", "statefulset"):
        for item in json.loads(kubectl("-n", NS, "get", kind, "-o", "json"))["items"]:
            want = item["spec"].get("replicas", 1)
            ready = item.get("status", {}).get("readyReplicas", 0)
            if ready < want:
                pending.append(f"{kind}/{item['metadata']['name']} {ready}/{want}")
    for item in json.loads(kubectl("-n", NS, "get", "job", "-o", "json"))["items"]:
        if not item.get("status", {}).get("succeeded"):
            pending.append(f"job/{item['metadata']['name']}")
    for pod in json.loads(kubectl("-n", NS, "get", "pod", "-o", "json"))["items"]:
        phase = pod["status"].get("phase")
        if phase == "Succeeded":
            continue
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
        if conds.get("Ready") != "True":
            pending.append(f"pod/{pod['metadata']['name']} {phase}")
    return pending


def wait_ready(summary: Summary, timeout_s: float) -> bool:
    t0 = time.monotonic()
    last: list[str] = []

    def ready() -> bool:
        nonlocal last
        last = not_ready()
        return not last

    try:
        wait_until("every workload ready", ready, timeout_s, every_s=5)
    except TimeoutError as exc:
        summary.check(False, "every workload ready, probes passing", f"{exc}; waiting: {last}")
        print(kubectl("-n", NS, "get", "pods", "-o", "wide", check=False))
        print(kubectl("-n", NS, "get", "events", "--sort-by=.lastTimestamp", check=False)[-4000:])
        return False
    pods = len(json.loads(kubectl("-n", NS, "get", "pod", "-o", "json"))["items"])
    summary.check(
        True, "every workload ready, probes passing", f"{pods} pods in {time.monotonic() - t0:.0f}s"
    )
    return True


def cluster_ip(service: str) -> str:
    return kubectl("-n", NS, "get", "svc", service, "-o", "jsonpath={.spec.clusterIP}")


def pods(name: str) -> list[dict[str, Any]]:
    items = json.loads(kubectl("-n", NS, "get", "pod", "-l", f"app.kubernetes.io/name={name}", "-o", "json"))
    return list(items["items"])


# --- 5: a job, two pods deleted mid-job ---------------------------------------------------
def code_spec(taskset: str, *, name: str, episodes: int, iterations: int) -> dict[str, Any]:
    """The small job on the code environment: each episode holds a sandbox session on a
    worker (so a worker's deletion has sessions to lose) and is scored by the hidden tests."""
    spec = small_spec(taskset, name=name)
    spec["policy"]["sampling"]["max_tokens"] = 24
    spec["environment"] = {
        "kind": "code",
        "max_turns": 1,
        "system_prompt": "",
        "limits": {"wall_s": 10, "memory_mb": 256},
    }
    spec["rewards"] = {"tests_passed": 1.0}
    spec["schedule"].update(
        iterations=iterations, episodes_per_iteration=episodes, max_concurrent_episodes=episodes
    )
    return spec


EVENTS_READER = r"""
import asyncio, json, sys, uuid
from aiokafka import AIOKafkaConsumer
async def main(job):
    c = AIOKafkaConsumer("events", bootstrap_servers="temper-kafka-kafka-bootstrap:9092",
                         group_id="k8s-test-" + uuid.uuid4().hex[:8], auto_offset_reset="earliest")
    await c.start()
    job_states, episodes, rewards = [], set(), 0
    try:
        while True:
            batch = await c.getmany(timeout_ms=3000)
            if not batch:
                break
            for records in batch.values():
                for r in records:
                    doc = json.loads(r.value)
                    if doc.get("job_id") != job:
                        continue
                    if doc.get("event") == "job.state":
                        job_states.append(doc.get("state"))
                    elif doc.get("event") == "episode.state":
                        episodes.add(doc.get("episode_id"))
                    elif doc.get("event") == "episode.reward":
                        rewards += 1
    finally:
        await c.stop()
    print(json.dumps({"job_states": job_states, "episodes": len(episodes), "rewards": rewards}))
asyncio.run(main(sys.argv[1]))
"""


def events_in_cluster(job_id: str) -> dict[str, Any]:
    pod = pods("temper-dispatcher")[0]["metadata"]["name"]
    out = kubectl("-n", NS, "exec", "-i", pod, "--", "python", "-", job_id, input=EVENTS_READER, timeout=120)
    return dict(json.loads(out.strip().splitlines()[-1]))


def trajectories_in_minio(tenant: str, job_id: str) -> int:
    from minio import Minio

    keys = json.loads(kubectl("-n", NS, "get", "secret", "temper-minio", "-o", "json"))["data"]
    client = Minio(
        f"{cluster_ip('temper-minio')}:9000",
        base64.b64decode(keys["access-key"]).decode(),
        base64.b64decode(keys["secret-key"]).decode(),
        secure=False,
    )
    prefix = f"tenants/{tenant}/jobs/{job_id}/trajectories/"
    return sum(1 for _ in client.list_objects("temper", prefix=prefix, recursive=True))


def job_with_deletions(api: Api, taskset: str, summary: Summary, result: dict[str, Any]) -> None:
    episodes, iterations = 8, 4
    job_id = api.submit(code_spec(taskset, name="k8s-test", episodes=episodes, iterations=iterations))
    t0 = time.monotonic()

    wait_until(
        "the job's first finished episode", lambda: api.progress(job_id)["finished"] > 0, 600, every_s=2
    )
    for name in ("temper-sandbox-worker", "temper-inference-gateway"):
        victim = pods(name)[0]["metadata"]["name"]
        kubectl("-n", NS, "delete", "pod", victim, "--wait=false")
        summary.check(True, f"deleted {name} pod mid-job", f"{victim} at {time.monotonic() - t0:.0f}s")
    job = api.wait_finished(job_id, timeout_s=900)
    result["job_outcome"] = job["state"] if job else "not completed"
    result["job_s"] = round(time.monotonic() - t0, 1)
    if job is None:
        return
    progress = api.progress(job_id)
    total = episodes * iterations
    counts = progress["episodes_by_state"]
    summary.check(
        progress["finished"] == progress["episodes_total"] == total and not counts.get("failed"),
        "every episode finished once, none failed",
        f"{counts}, {progress['finished']} of {total}",
    )
    n = trajectories_in_minio(api.tenant, job_id)
    summary.check(n >= total, "trajectories in the in-cluster MinIO", f"{n} objects")
    seen = events_in_cluster(job_id)
    summary.check(
        seen["job_states"][-1:] == ["completed"] and seen["episodes"] == total and seen["rewards"] >= total,
        "the job's events on the in-cluster Kafka (its states, every episode, every reward)",
        json.dumps(seen),
    )


# --- 6: KEDA scales the sandbox workers on lag --------------------------------------------
def ready_workers() -> int:
    count = 0
    for pod in pods("temper-sandbox-worker"):
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
        count += conds.get("Ready") == "True" and pod["metadata"].get("deletionTimestamp") is None
    return count


def consuming(pod: dict[str, Any]) -> bool:
    """A worker that handled sandbox.requests: its own counter on its /metrics."""
    import httpx

    ip = pod["status"].get("podIP")
    if not ip:
        return False
    try:
        text = httpx.get(f"http://{ip}:8002/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    for line in text.splitlines():
        if line.startswith("temper_bus_messages_consumed_total") and 'topic="sandbox.requests"' in line:
            if float(line.rsplit(" ", 1)[1]) > 0:
                return True
    return False


# A burst of sandbox work, sent from inside the cluster with Temper's own bus client: each
# request makes a session and runs a 2 s command in it (nothing else sends this much work to
# the workers at once on 2 cores: a job's sandbox steps are milliseconds behind a slow model).
# The dispatcher knows no such episode and drops the results ("unknown episode").
BURST_SENDER = r"""
import asyncio, sys, uuid
from temper.bus.factory import make_bus
from temper.events import SandboxRequest, Topics
from temper.runtime import load_settings
async def main(n):
    bus = make_bus(load_settings())
    await bus.start()
    try:
        for i in range(n):
            episode = "k8s-burst-" + uuid.uuid4().hex[:12]
            await bus.send_message(Topics.SANDBOX_REQUESTS, SandboxRequest(
                job_id="k8s-burst", episode_id=episode, turn=0, attempt=1, session_id=episode,
                action={"kind": "run_command", "command": "sleep 2; echo done"}, snapshot_after=False))
            await bus.send_message(Topics.SANDBOX_REQUESTS, SandboxRequest(
                job_id="k8s-burst", episode_id=episode, turn=0, attempt=1, session_id=episode,
                action={"kind": "destroy"}, snapshot_after=False))
    finally:
        await bus.stop()
    print(n)
asyncio.run(main(int(sys.argv[1])))
"""


def burst(summary: Summary, result: dict[str, Any], requests: int = 240) -> None:
    wait_until("one sandbox worker before the burst", lambda: ready_workers() == 1, 900, every_s=5)
    pod = pods("temper-dispatcher")[0]["metadata"]["name"]
    t0 = time.monotonic()
    kubectl("-n", NS, "exec", "-i", pod, "--", "python", "-", str(requests), input=BURST_SENDER, timeout=300)
    summary.check(
        True, "a burst sent to sandbox.requests", f"{requests} sessions, each running a 2 s command"
    )
    try:
        wait_until("KEDA to scale the sandbox workers up", lambda: ready_workers() > 1, 600, every_s=2)
        result["scale_up_s"] = round(time.monotonic() - t0, 1)
        newest = sorted(pods("temper-sandbox-worker"), key=lambda p: p["metadata"]["creationTimestamp"])[-1]
        wait_until("the new worker to consume sandbox.requests", lambda: consuming(newest), 300, every_s=3)
        result["replicas_max"] = ready_workers()
        summary.check(
            True,
            "KEDA scaled sandbox workers up on lag",
            f"{result['replicas_max']} Ready {result['scale_up_s']}s after the burst, the newest consuming",
        )
    except TimeoutError as exc:
        summary.check(False, "KEDA scaled sandbox workers up on lag", str(exc))
        return
    t1 = time.monotonic()
    try:
        wait_until(
            "KEDA to scale the sandbox workers back to one",
            lambda: len(pods("temper-sandbox-worker")) == 1,
            900,
            every_s=5,
        )
        result["scale_down_s"] = round(time.monotonic() - t1, 1)
        summary.check(
            True,
            "KEDA scaled sandbox workers down after the burst",
            f"back to one {result['scale_down_s']}s later",
        )
    except TimeoutError as exc:
        summary.check(False, "KEDA scaled sandbox workers down after the burst", str(exc))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the namespace and KEDA in place")
    parser.add_argument("--skip-build", action="store_true", help="use the images already imported")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument(
        "--dry-run-only",
        nargs="+",
        metavar="OVERLAY",
        help="only install the CRDs and send these overlays through the API server (make check-deploy)",
    )
    args = parser.parse_args()
    summary = Summary("k8s-test")
    if args.dry_run_only:
        install_crds()
        for overlay in args.dry_run_only:
            dry_run(summary, overlay)
        summary.print()
        return 1 if summary.failed else 0
    result: dict[str, Any] = {"release": ENV["K8S_VERSION"], "keda": ENV["KEDA_VERSION"]}
    if not Path(KUBECONFIG).exists():
        summary.check(False, "a cluster to test", f"no {KUBECONFIG}: run make k8s-up first")
        summary.print()
        return 1
    try:
        # Every run deploys from nothing: an earlier run's namespace goes first.
        kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=300s", timeout=320)
        if not args.skip_build:
            step(summary, "binaries and images built here", build)
        n = step(summary, "CRDs installed from the operators' sources", install_crds)
        result["crds"] = n
        dry_run(summary)
        step(summary, "KEDA installed (its own manifests, images built here)", install_keda)
        bootstrap = make_secrets()
        t0 = time.monotonic()
        apply_local()
        if wait_ready(summary, 900):
            result["time_to_ready_s"] = round(time.monotonic() - t0, 1)
            base = f"http://{cluster_ip('temper-dispatcher')}:8000"
            api = Api(base, bootstrap, f"k8s-test-{secrets.token_hex(3)}", summary)
            taskset = api.upload_taskset(TASKSETS / "offset.jsonl", "offset")
            job_with_deletions(api, taskset, summary, result)
            if not args.skip_scaling:
                burst(summary, result)
    except Exception as exc:  # a broken step is a miss, reported with the others
        summary.check(False, "k8s-test ran to the end", f"{type(exc).__name__}: {exc}")
    finally:
        result["passed"] = not summary.failed
        result["checks"] = len(summary.rows)
        RESULT.write_text(json.dumps(result, indent=2) + "\n")
        if summary.failed:
            print(kubectl("-n", NS, "get", "pods", "-o", "wide", check=False))
        if not args.keep:
            kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=320)
    summary.print()
    return 1 if summary.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
