"""Fuzz the dispatcher's REST API with schemathesis against its own OpenAPI schema.

A dispatcher runs as its own process (embedded mode: SQLite, a local object store) with
a tenant, an admin API key and a task set; every operation gets positive and negative
cases from a fixed seed; each response goes through schemathesis's checks (no server
error, declared status codes, content types, response schemas, ...). The dispatcher's
resident memory (VmRSS) is read before and after.

    python bench/fuzz.py [--examples 200] [--seed 1] [--out bench/results/fuzz.json]

writes ``cases``, ``server_errors``, ``schema_failures`` (flat JSON, with the memory
figures), each distinct failure with a curl command to ``fuzz-failures.txt`` beside it,
and prints a table. The test suite runs the same
fuzzer for about three minutes (tests/services/dispatcher/test_dispatcher_fuzz.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Task-set upload and re-validation queue Celery work (a Redis broker): not part of the API
# under test here; they have their own tests in tests/libs/tasks.
SKIPPED = ("POST /v1/tasksets", "POST /v1/tasksets/{taskset_id}/validate")

# Schema-valid requests these operations refuse by design, which a schema cannot express:
# a spec naming a model, task set or environment this deployment does not have (422), and
# a page cursor that is not one the API handed out (400), and bytes that are no tar.gz with
# a valid environment.yaml (422).
NAMES_CHECKED = ("POST /v1/jobs", "GET /v1/jobs", "GET /v1/jobs/{job_id}/episodes", "POST /v1/environments")


@dataclass
class Result:
    cases: int = 0
    server_errors: int = 0
    schema_failures: int = 0
    operations: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # "METHOD path: title (status)" -> count
    examples: dict[str, str] = field(default_factory=dict)  # the same -> the first case, as curl
    seconds: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int, what: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(what + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _prepare(db_url: str) -> str:
    """A tenant with an admin key and a task set of one valid task; returns the key."""
    from temper.db import Database, Task, TaskSet
    from temper.settings import DatabaseSettings
    from temper.tenants import create_tenant

    db = Database(DatabaseSettings(url=db_url))
    async with db.session() as s:
        _, key = await create_tenant(s, name="fuzz", tenant_id="fuzz", admin=True)
        s.add(TaskSet(id="ts-fuzz", tenant_id="fuzz", name="fuzz", status="valid", task_count=1))
        await s.flush()
        s.add(
            Task(id="t1", task_set_id="ts-fuzz", key="t1", kind="code", prompt="Write add(a, b).",
                 spec={"files": {"add.py": "def add(a, b):\n    return a - b\n"}}, meta={}, status="valid")
        )  # fmt: skip
    await db.dispose()
    return key.key


@contextmanager
def dispatcher(data_dir: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """A dispatcher process on a free port over a fresh migrated SQLite database:
    (base URL, API key, process)."""
    from temper.db.migrate import upgrade

    data_dir.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite+aiosqlite:///{data_dir}/temper.db"
    upgrade(db_url)
    key = asyncio.run(_prepare(db_url))
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}",
        "TEMPER_MODE": "embedded",
        "TEMPER_DATA_DIR": str(data_dir),
        "TEMPER_DB__URL": db_url,
        "TEMPER_STORAGE__ROOT": str(data_dir / "objects"),
        "TEMPER_PORT": str(port),
        "TEMPER_HOST": "127.0.0.1",
        "TEMPER_LOG__LEVEL": "WARNING",
        "TEMPER_LOG__FILE": str(data_dir / "dispatcher.log"),
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.dispatcher"], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dispatcher did not start (exit {proc.poll()})")
            time.sleep(0.2)
        yield base, key, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fuzz(
    base: str, key: str, *, examples: int, seed: int, budget_s: float | None = None, only: str | None = None
) -> Result:
    """Every operation of the dispatcher's schema, positive then negative cases."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    result = Result()
    started = time.monotonic()
    operations = [op.ok() for op in schema.get_all_operations()]
    # revoking keys last: the fuzzer may well revoke its own key (id 1), after which
    # everything else would answer 401
    operations.sort(key=lambda op: op.method.upper() == "DELETE")
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        if label in SKIPPED or (only is not None and label != only):
            continue
        result.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if budget_s is not None and time.monotonic() - started > budget_s:
                break
            try:
                _operation_test(
                    op, label, mode, base=base, key=key, examples=examples, seed=seed, into=result
                )()
            except Unsatisfiable:  # nothing to make negative: an operation without parameters
                pass
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _operation_test(
    op: Any, label: str, mode: Any, *, base: str, key: str, examples: int, seed: int, into: Result
) -> Any:
    """A Hypothesis test that sends ``examples`` cases of one operation and records every
    check failure (without stopping or shrinking)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

    headers = {"Authorization": f"Bearer {key}"}
    excluded = [positive_data_acceptance] if label in NAMES_CHECKED else []

    @hseed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        into.cases += 1
        response = case.call(base_url=base, headers=headers, timeout=30)
        skip = list(excluded)
        if mode is GenerationMode.NEGATIVE and not _query_string_form(case.query):
            # a null, an object or a list has no query-string form: it is sent as something else
            # ("null") or not at all, so the request the server sees may be valid
            skip.append(negative_data_rejection)
        try:
            case.validate_response(response, headers=headers, excluded_checks=skip)
        except (AssertionError, BaseExceptionGroup) as exc:  # a Failure, or a FailureGroup of them
            if response.status_code >= 500:
                into.server_errors += 1
            else:
                into.schema_failures += 1
            for failure in getattr(exc, "exceptions", None) or [exc]:
                title = getattr(failure, "title", type(failure).__name__)
                name = f"{label} [{mode.value}]: {title} ({response.status_code})"
                into.failures[name] = into.failures.get(name, 0) + 1
                message = str(getattr(failure, "message", ""))[:300]
                into.examples.setdefault(name, f"{message}\n{case.as_curl_command()[:500]}")

    return run


def _query_string_form(query: dict[str, Any] | None) -> bool:
    """Whether every generated query value is a scalar a query string carries as itself."""
    return all(isinstance(v, str | int | float | bool) for v in (query or {}).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=250, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/fuzz.json")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--only", default=None, help="one operation, e.g. 'GET /v1/jobs'")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="temper-fuzz-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        with dispatcher(data_dir) as (base, key, proc):
            rss_before = rss_mb(proc.pid)
            result = fuzz(base, key, examples=args.examples, seed=args.seed, only=args.only)
            rss_after, rss_peak = rss_mb(proc.pid), rss_mb(proc.pid, "VmHWM")
    out = {
        "cases": result.cases,
        "server_errors": result.server_errors,
        "schema_failures": result.schema_failures,
        "operations": result.operations,
        "examples_per_operation_and_mode": args.examples,
        "seed": args.seed,
        "seconds": result.seconds,
        "rss_mb_before": round(rss_before, 1),
        "rss_mb_after": round(rss_after, 1),
        "rss_mb_peak": round(rss_peak, 1),
        "distinct_failures": len(result.failures),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")  # flat: one scalar per figure
    details = args.out.with_name(args.out.stem + "-failures.txt")
    details.write_text(
        "".join(f"{n} x {name}\n{result.examples[name]}\n\n" for name, n in result.failures.items())
    )
    rows = list(out.items())
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  {n:>5}  {name}" for name, n in sorted(result.failures.items())]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
