from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.exc import IntegrityError

from services.dispatcher.api.tasksets import make_router
from temper.db import Episode, Job, Tenant
from temper.storage import LocalStore
from temper.tasks import service
from temper.tasks.models import TaskStatus, parse_tasks

pytestmark = pytest.mark.timeout(60)

SET = "\n".join(
    [
        '{"id": "a", "prompt": "Write f", "tests": "assert f() == 1", "entry_point": "f"}',
        '{"id": "b", "kind": "math", "prompt": "1+1?", "answer": "2"}',
    ]
)


async def _tenant(db, name="acme"):
    async with db.session() as s:
        s.add(Tenant(id=name, name=name))


async def test_create_list_show_record_outcomes_and_exclude_invalid_tasks(database, tmp_path):
    await _tenant(database)
    store = LocalStore(tmp_path / "objects")
    async with database.session() as s:
        row = await service.create_taskset(s, store, "acme", "demo", parse_tasks(SET))
    assert await store.exists(row.storage_key)
    async with database.session() as s:
        assert [r.name for r in await service.list_tasksets(s, "acme")] == ["demo"]
        rows = await service.task_rows(s, row.id)
        assert [r.id for r in rows] == [f"{row.id}:a", f"{row.id}:b"]
        assert rows[0].prompt_hash and rows[0].tests_hash
        spec = await service.load_task(s, f"{row.id}:a")
        assert spec.entry_point == "f"
        await service.set_task_status(s, f"{row.id}:b", TaskStatus.invalid, ["tests too weak"])
    async with database.session() as s:
        assert [t.key for t in await service.sampleable_tasks(s, row.id)] == ["a"]
        s.add(Job(id="j", tenant_id="acme", name="j", spec={}))
        await s.flush()
        for i, outcome in enumerate((True, True, False)):
            s.add(Episode(id=f"e{i}", job_id="j", tenant_id="acme", task_id=f"{row.id}:a", group_id="g"))
            await s.flush()
            service.record_outcome(
                s, episode_id=f"e{i}", task_id=f"{row.id}:a", job_id="j",
                policy_version=i // 2, passed=outcome, reward=float(outcome),
            )  # fmt: skip
    async with database.session() as s:
        (a, b) = await service.task_rows(s, row.id)
        totals = await service.task_totals(s, row.id)
        assert totals == {a.id: (3, 2)}
        view = service.task_view(a, totals[a.id])
        assert (view["attempts"], view["passes"]) == (3, 2)
        assert view["difficulty"] == pytest.approx(1 - 3 / 5)
        assert service.task_view(b)["attempts"] == 0
        by_version = await s.execute(service.outcome_totals(job_id="j", policy_version=1))
        assert [tuple(r) for r in by_version] == [(a.id, 1, 0)]
        with pytest.raises(IntegrityError):  # one outcome per episode
            async with s.begin_nested():
                service.record_outcome(
                    s, episode_id="e0", task_id=a.id, job_id="j", policy_version=0, passed=True, reward=1.0
                )
        with pytest.raises(service.TaskSetNotFound):
            await service.get_taskset(s, row.id, tenant="other")


async def test_rest_upload_list_and_status(database, tmp_path):
    await _tenant(database)

    class Rt:  # the parts of Runtime the routes use
        db = database
        store = LocalStore(tmp_path / "objects")

    queued: list[str] = []

    def enqueue(ts: str) -> str:
        queued.append(ts)
        return "celery-1"

    app = FastAPI()
    app.state.runtime = Rt()
    app.include_router(make_router(lambda: "acme", enqueue=enqueue))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post(
            "/v1/tasksets?name=demo", content=SET, headers={"content-type": "application/x-ndjson"}
        )
        assert r.status_code == 201, r.text
        ts = r.json()
        assert ts["task_count"] == 2 and ts["validation"] == {"queued": True, "validation_id": "celery-1"}
        assert queued == [ts["id"]]
        bad = SET + '\n{"id": "c", "kind": "code", "prompt": "x"}'
        r = await client.post("/v1/tasksets", content=bad, headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 422
        assert r.json()["errors"][0]["line"] == 3 and "hidden tests" in r.json()["errors"][0]["message"]
        r = await client.post(
            "/v1/tasksets",
            content="tasks:\n  - {id: y, kind: math, prompt: p, answer: '3'}\n",
            headers={"content-type": "application/yaml"},
        )
        assert r.status_code == 201
        r = await client.get("/v1/tasksets")
        assert [t["name"] for t in r.json()] == ["demo", "taskset"]
        r = await client.get(f"/v1/tasksets/{ts['id']}")
        body = r.json()
        assert body["progress"] == {"current": 0, "total": 2}
        assert [t["status"] for t in body["tasks"]] == ["pending", "pending"]
        assert (await client.get("/v1/tasksets/nope")).status_code == 404
        assert (await client.post(f"/v1/tasksets/{ts['id']}/validate")).status_code == 202


def test_cli_progress_bar_and_validation_wait():
    import io

    from temper.cli.tasksets import parse_weights, progress_bar, wait_for_validation

    assert progress_bar(3, 6, width=6) == "[###...] 3/6"
    assert parse_weights("tests_passed=1, coverage=0.2,format") == {
        "tests_passed": 1.0,
        "coverage": 0.2,
        "format": 1.0,
    }
    views = iter([
        {"status": "validating", "progress": {"current": 1, "total": 2}, "counts": {"valid": 1, "pending": 1}},
        {"status": "validated", "progress": {"current": 2, "total": 2}, "counts": {"valid": 1, "invalid": 1}},
    ])  # fmt: skip

    class Api:
        def _call(self, method, path, **kw):
            return next(views)

    out = io.StringIO()
    view = wait_for_validation(Api(), "ts", interval=0, stream=out)
    assert view["counts"]["invalid"] == 1 and "2/2 valid 1  invalid 1" in out.getvalue()


async def test_pass_rates_per_job_and_policy_version_over_rest(database, tmp_path):
    await _tenant(database)
    await _tenant(database, "other")
    async with database.session() as s:
        row = await service.create_taskset(s, None, "acme", "lineage", parse_tasks(SET))
        a, b = f"{row.id}:a", f"{row.id}:b"
        runs = {"full_marks": 1.0, "oracle": {"reward": 1.0, "passed": True, "failure": None}, "null": None}
        await service.set_task_status(s, a, TaskStatus.valid, [], validation=runs)
        for job in ("j1", "j2"):
            s.add(Job(id=job, tenant_id="acme", name=job, spec={"tasks": {"taskset": row.id}}))
        await s.flush()
        # j1: task a at version 0 (1 of 2) and version 1 (2 of 2); j2 starts over: 0 of 1
        for n, (job, task, version, ok) in enumerate([
            ("j1", a, 0, True), ("j1", a, 0, False), ("j1", a, 1, True), ("j1", a, 1, True),
            ("j2", a, 0, False), ("j1", b, 1, False),
        ]):  # fmt: skip
            s.add(Episode(id=f"e{n}", job_id=job, tenant_id="acme", task_id=task, group_id="g"))
            await s.flush()
            service.record_outcome(s, episode_id=f"e{n}", task_id=task, job_id=job,
                                   policy_version=version, passed=ok, reward=float(ok))  # fmt: skip
    async with database.session() as s:
        # what the curriculum of a job that starts from j1 counts: j1's outcomes plus its own
        rows = await s.execute(service.outcome_totals(taskset_id=row.id, job_ids=["j2", "j1"]))
        assert sorted(tuple(r) for r in rows) == [(a, 5, 3), (b, 1, 0)]
        rows = await s.execute(service.outcome_totals(taskset_id=row.id, job_ids=["j2"]))
        assert [tuple(r) for r in rows] == [(a, 1, 0)]

    app = FastAPI()

    class Rt:
        db = database
        store = None

    app.state.runtime = Rt()
    tenant = {"t": "acme"}
    app.include_router(make_router(lambda: tenant["t"], enqueue=lambda ts: "x"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.get(f"/v1/tasksets/{row.id}/tasks")
        assert r.status_code == 200, r.text
        ta, tb = r.json()
        assert (ta["key"], ta["attempts"], ta["passes"], ta["status"]) == ("a", 5, 3, "valid")
        assert ta["validation"]["oracle"]["passed"] is True and tb["validation"] is None
        assert ta["jobs"] == [
            {"job_id": "j1", "attempts": 4, "passes": 3, "pass_rate": 0.75, "versions": [
                {"policy_version": 0, "attempts": 2, "passes": 1, "pass_rate": 0.5},
                {"policy_version": 1, "attempts": 2, "passes": 2, "pass_rate": 1.0}]},
            {"job_id": "j2", "attempts": 1, "passes": 0, "pass_rate": 0.0, "versions": [
                {"policy_version": 0, "attempts": 1, "passes": 0, "pass_rate": 0.0}]},
        ]  # fmt: skip
        assert tb["jobs"][0]["versions"] == [
            {"policy_version": 1, "attempts": 1, "passes": 0, "pass_rate": 0.0}
        ]
        only = (await client.get(f"/v1/tasksets/{row.id}/tasks", params={"job": "j2"})).json()
        assert [(t["key"], t["attempts"], [j["job_id"] for j in t["jobs"]]) for t in only] == [
            ("a", 1, ["j2"]), ("b", 0, [])]  # fmt: skip
        assert ta["difficulty"] == pytest.approx(1 - 4 / 7)
        tenant["t"] = "other"
        assert (await client.get(f"/v1/tasksets/{row.id}/tasks")).status_code == 404


def test_cli_validate_prints_the_per_task_oracle_table(capsys):
    from temper.cli.tasksets import validation_table, write_validation_table

    tasks = [
        {"key": "HumanEval/23", "status": "valid", "reasons": [], "validation": {
            "oracle": {"reward": 1.0, "passed": True}, "null": {"reward": 0.0, "passed": False}}},
        {"key": "presolved", "status": "invalid", "reasons": ["a do-nothing agent passes (reward 1)"],
         "validation": {"oracle": {"reward": 1.0, "passed": True}, "null": {"reward": 1.0, "passed": True}}},
        {"key": "pending-one", "status": "pending", "reasons": [], "validation": None},
    ]  # fmt: skip
    lines = validation_table(tasks).splitlines()
    assert lines[0].split() == ["task", "status", "oracle", "do-nothing", "reasons"]
    assert lines[1].split() == ["HumanEval/23", "valid", "1", "pass", "0", "fail"]
    assert lines[2].split()[:6] == ["presolved", "invalid", "1", "pass", "1", "pass"]
    assert lines[2].endswith("a do-nothing agent passes (reward 1)")
    assert lines[3].split() == ["pending-one", "pending", "-", "-"]

    class Api:
        def _call(self, method, path, **kw):
            assert (method, path) == ("GET", "/v1/tasksets/ts-1")
            return {"tasks": tasks, "task_count": 3, "counts": {"valid": 1, "invalid": 1, "pending": 1}}

    import io

    out = io.StringIO()
    write_validation_table(Api(), "ts-1", out)
    assert out.getvalue().endswith("1 valid, 1 invalid of 3\n")
