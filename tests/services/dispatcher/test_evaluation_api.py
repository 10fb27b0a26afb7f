"""Evaluations over REST and the CLI: a spec's ``evaluation`` section checked at the door (its
task set, its split's tasks, its pool; ``evaluate`` is the server's), and a stored version
evaluated as a job of its own (``POST /v1/jobs/{id}/evaluations``, ``temper eval``): the
evaluation job holds the version under its own id and tells the gateway, with every field
resolved and every bad one named."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from temper.db import Database, Evaluation, OutboxRow, PolicyVersion, Task, TaskSet
from temper.events import Topics, decode
from tests.services.dispatcher.conftest import SPEC
from tests.services.dispatcher.test_dispatcher_cli import run_cli, server  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

HELD = ("h1", "h2", "h3")


def key_of(version: int) -> str:
    return f"tenants/acme/jobs/job-finished/versions/v{version}/manifest.json"


async def add_rows(settings) -> None:
    """Tasks of ts-acme (two to train on, three held out), a task set with no held-out part,
    and the finished job's versions."""
    db = Database(settings.db)
    try:
        async with db.session() as s:
            for key in ("a1", "a2", *HELD):
                s.add(Task(id=f"ts-acme:{key}", task_set_id="ts-acme", key=key, kind="code", prompt=f"do {key}",
                           spec={"tests": "assert True"}, meta={}, status="valid",
                           split="held_out" if key in HELD else "train"))  # fmt: skip
            s.add(TaskSet(id="ts-flat", tenant_id="acme", name="flat", status="valid", task_count=1))
            await s.flush()
            s.add(Task(id="ts-flat:x", task_set_id="ts-flat", key="x", kind="code", prompt="x",
                       spec={"tests": "assert True"}, meta={}, status="valid"))  # fmt: skip
            for v in (1, 2, 3):
                s.add(PolicyVersion(job_id="job-finished", version=v, checkpoint_key=key_of(v), step=2 * v))
    finally:
        await db.dispose()


def evaluation_spec(**section) -> dict:
    return {**SPEC, "name": "with-eval", "evaluation": {"every_versions": 2, **section}}


async def test_a_specs_evaluation_is_checked_at_the_door(client, env):
    await add_rows(env[0])
    r = await client.post("/v1/jobs", json=evaluation_spec(samples=2, pass_at=[2, 1]))
    assert r.status_code == 201, r.text
    stored = r.json()["spec"]["evaluation"]
    assert stored["split"] == "held_out" and stored["taskset"] is None and stored["pass_at"] == [1, 2]
    assert r.json()["evaluates"] is None
    # a task set by name is stored by id
    r = await client.post("/v1/jobs", json=evaluation_spec(taskset="adders", split="train"))
    assert r.status_code == 201 and r.json()["spec"]["evaluation"]["taskset"] == "ts-acme", r.text

    async def refused(body: dict) -> dict[str, str]:
        r = await client.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        return {e["field"]: e["message"] for e in r.json()["errors"]}

    errors = await refused(evaluation_spec(taskset="ts-other"))
    assert "no task set of yours" in errors["evaluation.taskset"]
    flat = {**evaluation_spec(), "tasks": {**SPEC["tasks"], "taskset": "ts-flat"}}
    errors = await refused(flat)
    assert "task set ts-flat has no held_out tasks" in errors["evaluation.split"]
    assert "--held-out" in errors["evaluation.split"]
    errors = await refused(evaluation_spec(backend_pool="gpus"))
    assert "no backend pool 'gpus'" in errors["evaluation.backend_pool"]
    errors = await refused({**SPEC, "evaluate": {"job": "job-finished", "version": 1}})
    assert "set by the server" in errors["evaluate"]
    errors = await refused(evaluation_spec(samples=2, pass_at=[4]))
    assert any("k=4 exceeds samples (2)" in m for m in errors.values()), errors


async def test_a_stored_version_is_evaluated_as_a_job_of_its_own(client, env):
    settings, _ = env
    await add_rows(settings)
    r = await client.post(
        "/v1/jobs/job-finished/evaluations", json={"version": 2, "samples": 3, "pass_at": [1, 3]}
    )
    assert r.status_code == 201, r.text
    made = r.json()
    eval_job = made["evaluation_job_id"]
    assert (made["source_job_id"], made["version"], made["taskset"], made["split"]) == (
        "job-finished", 2, "ts-acme", "held_out")  # fmt: skip
    assert (made["state"], made["samples"], made["ks"], made["periodic"]) == ("pending", 3, [1, 3], False)

    job = (await client.get(f"/v1/jobs/{eval_job}")).json()
    spec = job["spec"]
    assert job["evaluates"] == {"job": "job-finished", "version": 2, "model": None, "label": "eval",
                                "split": "held_out", "periodic": False}  # fmt: skip
    assert spec["evaluate"]["pass_at"] == [1, 3] and spec["tracking"] == {"mlflow": None, "wandb": None}
    assert spec["tasks"]["group_size"] == 3 and spec["schedule"]["episodes_per_iteration"] == 3 * len(HELD)
    assert spec["schedule"]["iterations"] == 1 and spec["policy"]["sampling"] == SPEC_SAMPLING
    assert job["provenance"]["evaluates"] == {"job": "job-finished", "version": 2, "model": None}

    db = Database(settings.db)
    try:
        async with db.session() as s:
            own = await s.get(PolicyVersion, (eval_job, 2))
            row = await s.get(Evaluation, eval_job)
            sent = [decode(o.payload) for o in (await s.execute(select(OutboxRow))).scalars()
                    if o.topic == Topics.POLICY_UPDATES]  # fmt: skip
    finally:
        await db.dispose()
    assert own is not None and own.checkpoint_key == key_of(2) and own.step == 4 and own.served_at is None
    assert row.checkpoint_key == key_of(2) and row.periodic_key is None
    assert [(m.job_id, m.version, m.checkpoint_key) for m in sent] == [(eval_job, 2, key_of(2))]

    listed = (await client.get("/v1/jobs/job-finished/evaluations")).json()
    assert [e["evaluation_job_id"] for e in listed] == [eval_job] and listed[0]["tasks"] is None
    own_listing = (await client.get(f"/v1/jobs/{eval_job}/evaluations?tasks=true")).json()
    assert own_listing[0]["evaluation_job_id"] == eval_job and own_listing[0]["tasks"] == []
    metrics = (await client.get("/v1/jobs/job-finished/metrics")).json()
    assert [p["version"] for p in metrics["evaluations"]] == [2] and metrics["evaluations"][0][
        "pass_at"
    ] == {}

    async def refused(ref: str, body: dict, status: int = 422) -> dict[str, str]:
        r = await client.post(f"/v1/jobs/{ref}/evaluations", json=body)
        assert r.status_code == status, r.text
        return {e["field"]: e["message"] for e in r.json().get("errors", [])} or {
            "detail": r.json()["detail"]
        }

    assert "has not published v9" in (await refused("job-finished", {"version": 9}))["version"]
    assert "one of the two" in (await refused("job-finished", {"version": 1, "model": "/tmp"}))["version"]
    assert "one of the two" in (await refused("job-finished", {}))["version"]
    assert (
        "not a complete model directory"
        in (await refused("job-finished", {"model": "/nonexistent"}))["model"]
    )
    errors = await refused("job-finished", {"version": 1, "passed_by": "coverage"})
    assert "'coverage' is not default, reward" in errors["passed_by"]
    errors = await refused("job-finished", {"version": 1, "samples": 2, "pass_at": [1, 5]})
    assert any("k=5 exceeds samples (2)" in m for m in errors.values()), errors
    assert (
        "no task set of yours"
        in (await refused("job-finished", {"version": 1, "taskset": "nope"}))["taskset"]
    )
    assert "is an evaluation" in (await refused(eval_job, {"version": 1}))["(job)"]
    await refused("job-nope", {"version": 1}, status=404)


SPEC_SAMPLING = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 64, "stop": []}


async def test_temper_eval_and_evals_from_the_cli(server, env, capsys, tmp_path):  # noqa: F811 - the fixture
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    await add_rows(env[0])
    code, out, err = run_cli([*base, "eval", "job-finished", "--version", "3", "--samples", "2",
                              "--pass-at", "1,2", "--split", "all", "--temperature", "0.2"], capsys)  # fmt: skip
    assert code == 0, err
    eval_job = out.strip()
    assert eval_job.startswith("job-") and "evaluating v3 of job-finished on ts-acme (all)" in err
    code, out, err = run_cli([*base, "evals", "job-finished", "--json"], capsys)
    assert code == 0, err
    (point,) = json.loads(out)
    assert (point["evaluation_job_id"], point["version"], point["samples"], point["split"]) == (
        eval_job,
        3,
        2,
        "all",
    )
    code, out, err = run_cli([*base, "show", eval_job, "--json"], capsys)
    assert json.loads(out)["spec"]["policy"]["sampling"]["temperature"] == 0.2
    code, out, _ = run_cli([*base, "evals", "job-finished"], capsys)
    assert out.splitlines()[0].split()[:3] == ["version", "label", "state"] and "v3" in out
    out_file = tmp_path / "evaluations.jsonl"
    code, _, err = run_cli([*base, "export", "job-finished", "--evaluations", "-o", str(out_file)], capsys)
    assert code == 0 and "1 evaluations" in err, err
    (exported,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert exported["evaluation_job_id"] == eval_job and exported["tasks"] == []
    code, _, err = run_cli([*base, "eval", "job-finished"], capsys)
    assert code == 2 and "give --version V or --model DIR" in err
    code, _, err = run_cli([*base, "eval", "job-finished", "--version", "8"], capsys)
    assert code == 1 and "version: job job-finished has not published v8" in err


async def finished_evaluations(settings) -> None:
    """Two finished periodic evaluations of job-finished (v0 and v2), as the dispatcher leaves them."""
    from temper.clock import utcnow
    from temper.db import EvaluationResult, Job

    db = Database(settings.db)
    try:
        async with db.session() as s:
            for v, (p1, p2) in ((0, (0.25, 0.5)), (2, (0.75, 1.0))):
                s.add(Job(id=f"job-eval-{v}", tenant_id="acme", name=f"add-numbers: eval v{v}", spec={},
                          state="completed"))  # fmt: skip
                await s.flush()
                s.add(Evaluation(job_id=f"job-eval-{v}", tenant_id="acme", source_job_id="job-finished", version=v,
                                 label="eval", periodic=True, taskset_id="ts-acme", split="held_out", samples=2,
                                 pass_at=[1, 2], completed_at=utcnow(),
                                 summary={"pass_at": {"1": p1, "2": p2}, "reward_mean": p1, "episodes": 6,
                                          "components": {"tests_passed": p1}}))  # fmt: skip
                await s.flush()
                for task in HELD:
                    s.add(EvaluationResult(job_id=f"job-eval-{v}", task_id=f"ts-acme:{task}", samples=2, passed=1,
                                           pass_at={"1": 0.5, "2": 1.0}, reward_mean=0.5,
                                           components={"tests_passed": 0.5}))  # fmt: skip
            job = await s.get(Job, "job-finished")
            job.provenance = {"temper": {"version": "0.1.0", "commit": "c" * 40, "dirty": False},
                              "seeds": {"tasks.seed": 0}, "spec_sha256": "5" * 64,
                              "model": {"policy_model": "tiny", "source": "preset"},
                              "taskset": {"id": "ts-acme", "name": "adders", "tasks": 5, "sha256": "b" * 64}}  # fmt: skip
    finally:
        await db.dispose()


async def test_the_console_shows_the_eval_curve_the_per_task_table_and_the_provenance(
    app, client, env, seeded
):
    import re

    import httpx

    await add_rows(env[0])
    await finished_evaluations(env[0])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dispatcher") as browser:
        r = await browser.post("/console/login", data={"key": seeded.key, "next": "/console/"})
        assert r.status_code == 303
        page = (await browser.get("/console/jobs/job-finished")).text
    curve = re.search(r'<svg id="eval-curve"[^>]*data-points="(\d+)"', page)
    assert curve and curve.group(1) == "2"
    assert 'id="reward-curve"' in page  # beside the reward curve
    # one line per k, a point per version with its value in the tooltip
    assert page.count('class="series" data-k="') == 2
    assert "v2: pass@2 1.000" in page and "v0: pass@1 0.250" in page
    table = page[page.index('id="eval-tasks"') :]
    table = table[: table.index("</table>")]
    assert "Per task at v2" in page and all(f"ts-acme:{t}" in table for t in HELD) and "1.000" in table
    assert 'href="/console/jobs/job-eval-2"' in page
    # the provenance, beside the spec
    assert 'id="provenance"' in page and "c" * 40 in page and "b" * 64 in page and "tasks.seed=0" in page


async def test_metrics_watch_and_compare_show_the_evaluations(server, env, capsys):  # noqa: F811 - the fixture
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    await add_rows(env[0])
    await finished_evaluations(env[0])
    code, out, err = run_cli([*base, "metrics", "job-finished"], capsys)
    assert code == 0, err
    section = out[out.index("evaluation per version") :].splitlines()
    assert section[1].split() == [
        "version",
        "label",
        "state",
        "tasks",
        "scored",
        "pass@1",
        "pass@2",
        "reward",
        "job",
    ]
    assert section[2].split()[:7] == ["v0", "eval", "completed", "ts-acme:held_out", "6", "0.250", "0.500"]
    assert section[3].split()[:7] == ["v2", "eval", "completed", "ts-acme:held_out", "6", "0.750", "1.000"]
    # the watch display's last line: the newest evaluation
    assert "  eval v2 (eval, held_out): pass@1 0.750 · pass@2 1.000   reward 0.750" in out
    code, out, err = run_cli([*base, "compare", "job-finished", "job-running"], capsys)
    assert code == 0, err
    rows = out[out.index("eval pass@1 per version") :].splitlines()
    assert rows[1].split() == ["version", "job-finished", "job-running"]
    assert rows[2].split() == ["v0", "0.250", "–"] and rows[3].split() == ["v2", "0.750", "–"]
