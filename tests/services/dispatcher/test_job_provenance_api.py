"""A job's provenance over REST and the CLI: recorded at submission (seeds, the spec's
digest, Temper's version and this checkout's commit, the initial model's and the task set's
digests, computed here from scratch), in the job's detail; ``POST /v1/jobs/{id}/rerun`` and
``temper rerun`` submit the same resolved spec as a new job that names the one it repeats."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from temper import __version__
from temper.db import Database, Job, Task
from temper.jobspec import JobSpec
from tests.services.dispatcher.conftest import SPEC
from tests.services.dispatcher.test_dispatcher_cli import run_cli, server  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]
TASKS = [
    {"id": "add-1", "kind": "code", "prompt": "add(a, b)", "spec": {"tests": "assert add(1, 2) == 3"}, "metadata": {}},
    {"id": "add-2", "kind": "code", "prompt": "add three", "spec": {"tests": "assert add(1, 2, 3) == 6"},
     "metadata": {"difficulty": 2}},
]  # fmt: skip


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


async def add_tasks(settings) -> str:
    """The seeded task set's tasks as rows; returns their digest, computed by hand."""
    db = Database(settings.db)
    try:
        async with db.session() as s:
            for t in TASKS:
                s.add(Task(id=f"ts-acme:{t['id']}", task_set_id="ts-acme", key=t["id"], kind=t["kind"],
                           prompt=t["prompt"], spec=t["spec"], meta=t["metadata"], status="valid"))  # fmt: skip
    finally:
        await db.dispose()
    return hashlib.sha256(b"\n".join(canonical(t) for t in sorted(TASKS, key=lambda t: t["id"]))).hexdigest()


def model_dir(path: Path) -> tuple[Path, str]:
    path.mkdir()
    files = {
        "config.json": b'{"model_type": "qwen2"}',
        "tokenizer.json": b"{}",
        "model.safetensors": b"\x00w",
    }
    for name, data in files.items():
        (path / name).write_bytes(data)
    listing = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    return path, hashlib.sha256(canonical(listing)).hexdigest()


def head() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


async def test_a_job_records_what_it_was_made_from_and_reruns_as_it_was(client, env, tmp_path):
    settings, _ = env
    tasks_sha = await add_tasks(settings)
    directory, model_sha = model_dir(tmp_path / "m")
    body = {**SPEC, "handle": "first", "tasks": {**SPEC["tasks"], "seed": 11}, "policy": {**SPEC["policy"], "init": str(directory)}}  # fmt: skip
    r = await client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job = r.json()
    p = job["provenance"]
    assert p["seeds"] == {"tasks.seed": 11}
    assert p["spec_sha256"] == hashlib.sha256(canonical(job["spec"])).hexdigest()
    assert p["temper"]["version"] == __version__ and p["temper"]["commit"] == head()
    assert p["model"] == {"policy_model": "tiny", "init": str(directory), "source": "directory",
                          "sha256": model_sha, "files": 3}  # fmt: skip
    assert p["taskset"] == {"id": "ts-acme", "name": "adders", "tasks": 2, "sha256": tasks_sha}
    assert "rerun_of" not in p
    assert (await client.get(f"/v1/jobs/{job['id']}")).json()["provenance"] == p

    # the rerun: the same resolved spec, a new job, no handle unless given one
    r = await client.post(f"/v1/jobs/{job['id']}/rerun")
    assert r.status_code == 201, r.text
    again = r.json()
    assert again["id"] != job["id"] and again["state"] == "pending" and again["handle"] is None
    assert again["spec"] == {**job["spec"], "handle": None}
    q = again["provenance"]
    assert q["rerun_of"] == job["id"]
    assert {k: q[k] for k in ("seeds", "model", "taskset", "temper")} == {
        k: p[k] for k in ("seeds", "model", "taskset", "temper")
    }
    assert q["spec_sha256"] == hashlib.sha256(canonical(again["spec"])).hexdigest()
    # by handle, with a new handle and name
    r = await client.post("/v1/jobs/first/rerun", json={"handle": "second", "name": "add-numbers again"})
    assert r.status_code == 201, r.text
    assert (r.json()["handle"], r.json()["name"], r.json()["provenance"]["rerun_of"]) == (
        "second",
        "add-numbers again",
        job["id"],
    )
    assert r.json()["spec"] == {**job["spec"], "handle": "second", "name": "add-numbers again"}
    # a taken handle is the spec's problem, named
    r = await client.post("/v1/jobs/first/rerun", json={"handle": "second"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "handle"
    r = await client.post("/v1/jobs/first/rerun", json={"handle": "Bad Handle"})
    assert r.status_code == 422


async def test_an_older_job_has_no_provenance_and_reruns_get_one(client, seeded):
    old = (await client.get(f"/v1/jobs/{seeded.job_id}")).json()
    assert old["provenance"] is None
    r = await client.post(f"/v1/jobs/{seeded.job_id}/rerun")
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["spec"] == old["spec"] and new["provenance"]["rerun_of"] == seeded.job_id
    # the model is a served name with no initial weights: the trainer's preset, no digest here
    assert new["provenance"]["model"]["source"] == "preset" and new["provenance"]["model"]["sha256"] is None


async def test_another_tenants_job_is_not_rerun(client, env):
    settings, seeded = env
    db = Database(settings.db)
    try:
        async with db.session() as s:
            spec = JobSpec.model_validate({**SPEC, "tasks": {**SPEC["tasks"], "taskset": "ts-other"}})
            s.add(Job(id="job-theirs", tenant_id="other", name="theirs", spec=spec.model_dump(mode="json")))
    finally:
        await db.dispose()
    assert (await client.post("/v1/jobs/job-theirs/rerun")).status_code == 404
    assert (await client.post("/v1/jobs/job-nope/rerun")).status_code == 404


def test_show_and_rerun_from_the_cli(server, capsys):  # noqa: F811 - the fixture
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    code, out, err = run_cli([*base, "rerun", seeded.job_id], capsys)
    assert code == 0, err
    new_id = out.strip()
    assert new_id.startswith("job-") and f"submitted {seeded.job_id} again as {new_id}" in err

    code, out, err = run_cli([*base, "show", new_id], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(new_id) and "add-numbers" in lines[0]
    text = "\n".join(lines)
    assert f"temper:        {__version__}, commit {head()}" in text
    assert "seeds:         tasks.seed=0" in text
    assert f"rerun of:      {seeded.job_id}" in text
    assert "task set:      ts-acme (adders, 0 tasks)" in text
    assert "model sha256:  none (no initial weights named" in text

    code, out, _ = run_cli([*base, "show", new_id, "--json"], capsys)
    shown = json.loads(out)
    assert shown["provenance"]["rerun_of"] == seeded.job_id and shown["spec"]["name"] == "add-numbers"

    code, out, _ = run_cli([*base, "show", seeded.job_id], capsys)
    assert "provenance: not recorded" in out

    code, _, err = run_cli([*base, "rerun", "job-nope"], capsys)
    assert code != 0 and "not found" in err
