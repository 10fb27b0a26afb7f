"""What the end-to-end checks of a deployment share (scripts/compose/compose_test.py, the
whole platform under compose; scripts/k8s/k8s_test.py, on the one-node Kubernetes): a
summary of checks, a bounded wait, and one small job submitted over REST with the
bootstrap admin key and followed to its end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TASKSETS = ROOT / "examples" / "tasksets"


class Summary:
    def __init__(self, label: str) -> None:
        self.label = label
        self.rows: list[tuple[bool, str, str]] = []
        self.t0 = time.monotonic()

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        self.rows.append((ok, what, detail))
        print(f"[{self.label}] {'ok  ' if ok else 'FAIL'} {what} {detail}", flush=True)
        return ok

    @property
    def failed(self) -> bool:
        return not self.rows or any(not ok for ok, _, _ in self.rows)

    def print(self) -> None:
        print(f"\n{self.label} summary ({time.monotonic() - self.t0:.0f}s):")
        for ok, what, detail in self.rows:
            print(f"  {'ok  ' if ok else 'FAIL'}  {what}" + (f": {detail}" if detail else ""))
        print(f"{self.label}: " + ("FAILED" if self.failed else "all passed"))


def wait_until(what: str, predicate: Callable[[], Any], timeout_s: float, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(every_s)


def small_spec(taskset: str, *, name: str, model: str = "temper-policy") -> dict[str, Any]:
    """tests/faults/harness.py's small job on a gateway's model: single-turn arithmetic on the
    tiny random policy, two iterations, every group trained."""
    return {
        "name": name,
        "policy": {"model": model, "sampling": {"temperature": 1.0, "max_tokens": 12}},
        "tasks": {"taskset": taskset, "group_size": 4, "curriculum": "uniform"},
        "environment": {"kind": "math", "max_turns": 1, "system_prompt": ""},
        "rewards": {"answer_match": 1.0},
        "algorithm": {
            "learning_rate": 0.001,
            "groups_per_step": 2,
            "checkpoint_every": 1,
            "skip_zero_variance": False,
        },
        "schedule": {
            "iterations": 2,
            "episodes_per_iteration": 8,
            "max_concurrent_episodes": 8,
            "max_staleness": 1,
        },
    }


class Api:
    """A tenant made with the bootstrap admin key, and its calls."""

    def __init__(self, base_url: str, admin_key: str, tenant_name: str, summary: Summary) -> None:
        self.base = base_url.rstrip("/") + "/v1"
        self.http = httpx.Client(timeout=60)
        self.summary = summary
        r = self.http.post(
            f"{self.base}/tenants",
            headers={"Authorization": f"Bearer {admin_key}"},
            json={"name": tenant_name, "max_concurrent_episodes": 64},
        )
        if not summary.check(
            r.status_code == 201, "tenant and key created (admin key)", f"HTTP {r.status_code}"
        ):
            raise RuntimeError(r.text)
        made = r.json()
        self.tenant, self.key = made["tenant"]["id"], made["key"]["key"]
        self.auth = {"Authorization": f"Bearer {self.key}"}

    def upload_taskset(self, path: Path, name: str) -> str:
        r = self.http.post(
            f"{self.base}/tasksets",
            params={"name": name, "validate": "false"},
            content=path.read_bytes(),
            headers={**self.auth, "Content-Type": "application/x-ndjson"},
        )
        if not self.summary.check(
            r.status_code in (200, 201), f"taskset {name} uploaded", f"HTTP {r.status_code}"
        ):
            raise RuntimeError(r.text)
        return str(r.json()["id"])

    def submit(self, spec: dict[str, Any]) -> str:
        r = self.http.post(f"{self.base}/jobs", headers=self.auth, json=spec)
        if not self.summary.check(
            r.status_code in (200, 201, 202), f"job {spec['name']} submitted", f"HTTP {r.status_code}"
        ):
            raise RuntimeError(r.text)
        return str(r.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"{self.base}/jobs/{job_id}", headers=self.auth)
        r.raise_for_status()
        return dict(r.json())

    def progress(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}/metrics' progress: episodes_by_state, finished, episodes_total."""
        r = self.http.get(f"{self.base}/jobs/{job_id}/metrics", headers=self.auth)
        r.raise_for_status()
        return dict(r.json()["progress"])

    def wait_finished(self, job_id: str, timeout_s: float = 600) -> dict[str, Any] | None:
        """The job once it ended; a check row says whether it completed."""
        t0 = time.monotonic()
        job: dict[str, Any] = {}

        def finished() -> bool:
            nonlocal job
            job = self.job(job_id)
            return job.get("state") in {"completed", "failed", "cancelled"}

        try:
            wait_until("the job to finish", finished, timeout_s, every_s=3)
        except TimeoutError as exc:
            self.summary.check(False, "job completed", f"{exc}; last: {json.dumps(job)[:400]}")
            return None
        ok = self.summary.check(
            job["state"] == "completed", "job completed", f"{job['state']} in {time.monotonic() - t0:.0f}s"
        )
        if not ok:
            print(json.dumps(job, indent=1)[:2000])
        return job if ok else None
