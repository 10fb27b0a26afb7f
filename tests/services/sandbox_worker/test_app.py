"""The sandbox worker over HTTP (sessions, run_tests, SandboxFusion /run_code) and its
idempotent bus handler, on the real bwrap backend."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from services.sandbox_worker.app import create_app
from services.sandbox_worker.worker import SandboxWorker
from temper.events import SandboxRequest
from temper.rewards.models import files_from_snapshot
from temper.sandbox import SandboxLimits, SandboxSettings
from temper.storage import LocalStore

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]

LIMITS = SandboxLimits(wall_s=3, cpu_s=3, memory_mb=128, pids=64, output_bytes=32 << 10, workspace_mb=16)


@pytest.fixture
def root():
    path = Path("/tmp") / f"temper-sbw-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_worker(root: Path, store: LocalStore, name: str = "a") -> SandboxWorker:
    settings = SandboxSettings(pool_size=1, default_limits=LIMITS, workspace_root=root / name)
    return SandboxWorker(settings, store=store, worker_id=f"worker-{name}")


@pytest.fixture
async def worker(root, tmp_path):
    w = make_worker(root, LocalStore(tmp_path / "objects"))
    await w.start()
    yield w
    await w.close()
    assert w.manager.leaked == 0


@pytest.fixture
async def client(worker):
    app = create_app(worker=worker)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        yield c


async def test_health_and_metrics(client, worker) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["components"]["cgroups"] in ("v1", "v2")
    worker.manager.leaked = 1
    r = await client.get("/health")
    assert r.status_code == 503 and "leaked" in r.json()["failing"][0]
    worker.manager.leaked = 0
    r = await client.get("/metrics")
    assert "temper_sandbox_pool_size" in r.text and "temper_sandbox_kills_total" in r.text


async def test_session_lifecycle_over_http(client) -> None:
    r = await client.post("/v1/sessions", json={"limits": LIMITS.model_dump()})
    assert r.status_code == 201
    sid = r.json()["session_id"]
    act = f"/v1/sessions/{sid}/actions"
    r = await client.post(act, json={"kind": "write_file", "path": "a.txt", "content": "hello"})
    assert r.json()["error"] is None
    r = await client.post(act, json={"kind": "run_command", "command": "cat a.txt | tr a-z A-Z"})
    assert r.json()["stdout"] == "HELLO" and r.json()["exit_code"] == 0
    r = await client.post(act, json={"kind": "run_python", "code": "while True: pass", "timeout_s": 0.5})
    assert r.json()["kill_reason"] == "timeout"
    key = (await client.post(f"/v1/sessions/{sid}/snapshot")).json()["key"]
    r = await client.post("/v1/sessions/restore", json={"key": key})
    other = r.json()["session_id"]
    r = await client.post(f"/v1/sessions/{other}/actions", json={"kind": "read_file", "path": "a.txt"})
    assert r.json()["content"] == "hello"
    missing = {"key": "sandbox-snapshots/nope/x.tar.gz"}
    assert (await client.post("/v1/sessions/restore", json=missing)).status_code == 404
    for s in (sid, other):
        assert (await client.delete(f"/v1/sessions/{s}")).status_code == 204
    assert (await client.post(act, json={"kind": "list_files"})).status_code == 404


async def test_run_tests(client) -> None:
    code = "def add(a, b):\n    return a + b\n"
    r = await client.post("/v1/run_tests", json={"code": code, "tests": "assert add(2, 3) == 5"})
    assert r.json()["passed"] is True
    r = await client.post("/v1/run_tests", json={"code": code, "tests": "assert add(2, 2) == 5"})
    assert r.json()["passed"] is False and "AssertionError" in r.json()["result"]["stderr"]


async def test_run_code_is_sandboxfusion_compatible(client) -> None:
    r = (
        await client.post(
            "/run_code", json={"code": "print(input()[::-1])", "language": "python", "stdin": "abc"}
        )
    ).json()
    assert r["status"] == "Success" and r["run_result"]["status"] == "Finished"
    assert r["run_result"]["stdout"] == "cba\n" and r["run_result"]["return_code"] == 0
    assert isinstance(r["run_result"]["execution_time"], float)
    r = (await client.post("/run_code", json={"code": "echo $((6*7)); exit 3", "language": "bash"})).json()
    assert (
        r["status"] == "Failed"
        and r["run_result"]["return_code"] == 3
        and r["run_result"]["stdout"] == "42\n"
    )
    py = {"language": "python"}
    r = (
        await client.post("/run_code", json={**py, "code": "import time; time.sleep(5)", "run_timeout": 0.5})
    ).json()
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"
    assert r["run_result"]["return_code"] is None and r["run_result"]["kill_reason"] == "timeout"
    files = {"data/in.txt": base64.b64encode(b"7\n").decode()}
    code = "n = int(open('data/in.txt').read()); open('out.txt', 'w').write(str(n * 6))"
    r = (
        await client.post("/run_code", json={**py, "code": code, "files": files, "fetch_files": ["out.txt"]})
    ).json()
    assert r["status"] == "Success" and base64.b64decode(r["files"]["out.txt"]) == b"42"
    # Past memory_limit_MB a Python program meets MemoryError, as SandboxFusion's (an
    # address-space limit): the run finished, its program failed with return code 1; a
    # run-level Error is a sandbox fault only, in SandboxFusion's meaning.
    r = (
        await client.post("/run_code", json={**py, "code": "x = bytearray(1 << 30)", "memory_limit_MB": 64})
    ).json()
    assert r["status"] == "Failed" and r["run_result"]["status"] == "Finished"
    assert r["run_result"]["return_code"] == 1 and r["run_result"]["kill_reason"] is None
    assert r["run_result"]["stderr"].rstrip().endswith("MemoryError")
    assert r["compile_result"] is None  # Python has no compile step
    # without memory_limit_MB there is no address-space limit: the sandbox's own memory limit kills
    r = (await client.post("/run_code", json={**py, "code": "x = bytearray(1 << 30)"})).json()
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["kill_reason"] == "memory"
    assert r["run_result"]["return_code"] == -9


async def test_truncated_output_is_not_success(client) -> None:
    r = (await client.post("/run_code", json={"language": "python", "code": "print('x' * 200000)"})).json()
    assert r["status"] == "Failed", "SandboxFusion would say Success here"
    assert r["run_result"]["stdout_truncated"] is True and "truncated" in r["message"]
    assert len(r["run_result"]["stdout"]) == LIMITS.output_bytes


async def test_handle_is_idempotent_and_restores_on_another_worker(root, tmp_path) -> None:
    store = LocalStore(tmp_path / "objects")
    a = make_worker(root, store, "a")
    await a.start()
    req = SandboxRequest(
        episode_id="ep-1", turn=1, attempt=0, session_id="ep-1",
        action={"kind": "run_command", "command": "echo $RANDOM >> log; wc -l < log"},
    )  # fmt: skip
    first, dup = await asyncio.gather(a.handle(req), a.handle(req))
    again = await a.handle(req.model_copy(update={"id": uuid.uuid4()}))
    assert first.result["stdout"] == "1\n" and dup.result == first.result and again.result == first.result
    assert first.snapshot_key and first.worker == "worker-a" and first.episode_id == "ep-1"
    await a.close()  # the worker dies; its session is gone

    b = make_worker(root, store, "b")
    await b.start()
    try:
        turn2 = SandboxRequest(
            episode_id="ep-1", turn=2, attempt=0, session_id="ep-1", snapshot_key=first.snapshot_key,
            action={"kind": "run_command", "command": "echo more >> log; wc -l < log"},
        )  # fmt: skip
        r = await b.handle(turn2)
        assert r.result["stdout"] == "2\n" and r.worker == "worker-b"
        bad = await b.handle(turn2.model_copy(update={"turn": 3, "action": {"kind": "fly"}}))
        assert bad.error and "invalid request" in bad.error
        done = await b.handle(turn2.model_copy(update={"turn": 4, "action": {"kind": "destroy"}}))
        assert done.error is None and "ep-1" not in b.manager.sessions
    finally:
        await b.close()


class RefusingOnce(LocalStore):
    """An object store that refuses the first upload of a snapshot, as one that is down does."""

    refused = 0

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        if "sandbox-snapshots/" in key and not self.refused:
            self.refused += 1
            raise ConnectionRefusedError("the object store is down")
        await super().put(key, data, content_type)


async def test_a_step_retried_after_its_snapshot_failed_does_not_run_its_action_again(root, tmp_path) -> None:
    """The snapshot's upload fails after the action ran (an object store outage): the bus
    retries the step, which takes the snapshot of the workspace the action left and answers
    with the action's result; the action ran once (it ran twice, on the workspace its first
    run had changed, and the episode's turn saw a workspace no snapshot held)."""
    store = RefusingOnce(tmp_path / "objects")
    w = make_worker(root, store)
    await w.start()
    try:
        req = SandboxRequest(
            episode_id="ep-1", turn=0, attempt=0, session_id="ep-1",
            action={"kind": "run_command", "command": "echo $RANDOM >> log; wc -l < log"},
        )  # fmt: skip
        with pytest.raises(ConnectionRefusedError):
            await w.handle(req)
        again = await w.handle(req)
        assert store.refused == 1 and again.error is None
        assert again.result["stdout"] == "1\n", "the action ran again"
        assert again.snapshot_key is not None
        log = files_from_snapshot(await store.get(again.snapshot_key))["log"]
        assert len(log.splitlines()) == 1
        turn1 = await w.handle(req.model_copy(update={"turn": 1}))  # the next turn runs as usual
        assert turn1.result["stdout"] == "2\n"
    finally:
        await w.close()


async def test_a_later_attempt_of_a_step_whose_actions_ran_does_not_run_them_again(root, tmp_path) -> None:
    """The bus gave up on a step whose snapshot could not be uploaded (the object store full
    for longer than its retries), and the dispatcher sent the step again as a new attempt to
    the worker holding the session. The actions ran again on the workspace their first run
    had changed, and the turn saw a workspace no snapshot held (a reduced-chaos run while the
    disk was full). The new attempt answers with the first run's results and its snapshot
    holds the workspace the actions left once; a different action at that turn still runs."""
    store = RefusingOnce(tmp_path / "objects")
    w = make_worker(root, store)
    await w.start()
    try:
        req = SandboxRequest(
            episode_id="ep-1", turn=0, attempt=0, session_id="ep-1",
            action={"kind": "run_command", "command": "echo $RANDOM >> log; wc -l < log"},
        )  # fmt: skip
        with pytest.raises(ConnectionRefusedError):
            await w.handle(req)
        later = await w.handle(req.model_copy(update={"attempt": 1}))
        assert later.error is None and later.attempt == 1
        assert later.result["stdout"] == "1\n", "the action ran again"
        log = files_from_snapshot(await store.get(later.snapshot_key))["log"]
        assert len(log.splitlines()) == 1 and later.snapshot_key.endswith("-a1.tar.gz")
        # a result that never reached the dispatcher: its next attempt gets the same answer
        again = await w.handle(req.model_copy(update={"attempt": 2}))
        assert (again.result, again.attempt) == (later.result, 2)
        other = await w.handle(
            req.model_copy(update={"attempt": 3, "action": {"kind": "run_command", "command": "wc -l < log"}})
        )
        assert other.result["stdout"] == "1\n"
    finally:
        await w.close()


async def test_bad_input_is_a_4xx_on_every_route_never_a_5xx(client, worker) -> None:
    """Finding 5: non-finite numbers, invalid storage keys and unknown image digests were
    answered with 500, a duplicate session id with 503."""
    nan, inf = float("nan"), float("inf")
    unknown = "sha256:" + "0" * 64
    sid = (await client.post("/v1/sessions", json={"session_id": "dup"})).json()["session_id"]
    act = f"/v1/sessions/{sid}/actions"
    bad: list[tuple[str, dict, int, str]] = [
        (
            "/run_code",
            {"code": "print(1)", "language": "python", "memory_limit_MB": nan},
            422,
            "memory_limit_MB",
        ),
        (
            "/run_code",
            {"code": "print(1)", "language": "python", "memory_limit_MB": inf},
            422,
            "memory_limit_MB",
        ),
        ("/run_code", {"code": "print(1)", "language": "python", "run_timeout": nan}, 422, "run_timeout"),
        ("/run_code", {"code": "print(1)", "language": "python", "run_timeout": -inf}, 422, "run_timeout"),
        ("/run_code", {"code": "print(1)", "language": "python3"}, 422, "language"),
        ("/run_code", {"code": "print(1)", "language": "cobol"}, 422, "language"),
        ("/run_code", {"code": "print(1)"}, 422, "language"),
        ("/v1/run_tests", {"code": "pass", "limits": {"memory_mb": nan}}, 422, "memory_mb"),
        ("/v1/run_tests", {"code": "pass", "limits": {"wall_s": inf}}, 422, "wall_s"),
        ("/v1/run_tests", {"code": "pass", "limits": {"image": unknown}}, 422, "image"),
        ("/v1/run_tests", {"code": "pass", "limits": {"memory_mb": 1 << 16}}, 422, "memory_mb"),
        ("/v1/run_tests", {"code": "pass", "files": {"/etc/x": "eA=="}}, 422, "files"),
        ("/v1/run_tests", {"code": "pass", "files": {"x": "%%%"}}, 422, "files"),
        ("/v1/sessions", {"limits": {"memory_mb": nan}}, 422, "memory_mb"),
        ("/v1/sessions", {"limits": {"cpu_s": nan}}, 422, "cpu_s"),
        ("/v1/sessions", {"limits": {"image": unknown}}, 422, "image"),
        ("/v1/sessions", {"session_id": "dup"}, 409, "dup"),
        ("/v1/sessions/restore", {"key": "../../../../etc/passwd"}, 422, "key"),
        ("/v1/sessions/restore", {"key": "/etc/passwd"}, 422, "key"),
        ("/v1/sessions/restore", {"key": "sandbox-snapshots/x/../../y"}, 422, "key"),
        (
            "/v1/sessions/restore",
            {"key": "sandbox-snapshots/none.tar.gz", "limits": {"pids": nan}},
            422,
            "pids",
        ),
        ("/v1/sessions/restore", {"key": "sandbox-snapshots/none.tar.gz", "session_id": "dup"}, 409, "dup"),
        (act, {"kind": "run_python", "code": "pass", "timeout_s": nan}, 422, "timeout_s"),
        (act, {"kind": "run_python", "code": "pass", "timeout_s": inf}, 422, "timeout_s"),
    ]
    for path, body, status, field in bad:
        # Python's json writes NaN and Infinity (as clients in many languages do); httpx's
        # json= would refuse to.
        r = await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == status and field in r.text, (path, body, r.status_code, r.text)
    # /run_code answers as SandboxFusion does for what it cannot run: 200, status SandboxError.
    for files in ({"../x": "eA=="}, {"x": "not base64!"}):
        r = await client.post("/run_code", json={"code": "print(1)", "language": "python", "files": files})
        assert r.status_code == 200 and r.json()["status"] == "SandboxError", r.text
        assert "file" in r.json()["message"] and "x" in r.json()["message"], r.text
    # The worker is still up and serves.
    r = await client.post("/run_code", json={"code": "print(6 * 7)", "language": "python"})
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n"
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204


async def test_bad_requests_on_the_bus_are_error_results_not_retries(worker) -> None:
    """The same refusals on sandbox.requests: a result with the error, at once (an
    exception would be retried and dead-lettered)."""

    def req(episode: str, **fields: object) -> SandboxRequest:
        return SandboxRequest(episode_id=episode, turn=1, attempt=0, session_id=episode, **fields)

    cases = [
        (req("ep-key", snapshot_key="../../../../etc/passwd", action={"kind": "list_files"}), "invalid"),
        (req("ep-max", limits={**LIMITS.model_dump(), "memory_mb": 60000}, action={"kind": "list_files"}),
         "memory_mb=60000 is above the operator's maximum"),
        (req("ep-nan", limits={**LIMITS.model_dump(), "cpu_s": float("nan")}, action={"kind": "list_files"}),
         "invalid request"),
        (req("ep-img", limits={**LIMITS.model_dump(), "image": "sha256:" + "ab" * 32}, action={"kind": "list_files"}),
         "not in object storage"),
    ]  # fmt: skip
    for request, error in cases:
        r = await worker.handle(request)
        assert r.error is not None and error in r.error, (request, r)
        assert request.session_id not in worker.manager.sessions
