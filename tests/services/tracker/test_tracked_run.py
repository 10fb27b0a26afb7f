"""``temper run`` of a small real job (real sandboxes, generation and gradient steps) with
``tracking.mlflow`` and ``tracking.wandb``: the job's MLflow run on a real server, and its
offline W&B run (read back from its ``.wandb`` file with wandb's own reader), hold its params,
tags, state and every metric point, with the values the run's database holds when it ends."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
from typing import Any

import pytest
import yaml

from services.cli import main
from temper import __version__
from temper.tracking import MlflowClient, WandbSink, flatten, flatten_values, read_records
from temper.tracking.mlflow import JOB_TAG
from temper.tracking.tracker import provenance_params
from temper.tracking.wandb_offline import history as wandb_history
from tests.services.embedded.test_temper_run import small_spec
from tests.services.tracker.mlflow_server import MlflowServer

NUMBERS = ("loss", "kl", "entropy", "grad_norm", "clip_fraction", "learning_rate", "tokens")


async def read_run(
    uri: str, experiment: str, job_id: str
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    client = MlflowClient(uri)
    try:
        run_id = await client.find_run(await client.experiment_id(experiment), JOB_TAG, job_id)
        assert run_id is not None, "the job has no run"
        run = await client.get_run(run_id)
        keys = {m["key"] for m in run["data"]["metrics"]}
        return run, {k: await client.metric_history(run_id, k) for k in keys}
    finally:
        await client.aclose()


@pytest.mark.mlflow
@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_temper_run_logs_the_job_to_mlflow_and_wandb(tmp_path, capsys, mlflow_server: MlflowServer):
    path = small_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    # a weak model can score every group flat: train on those too, so versions are published
    spec["algorithm"]["skip_zero_variance"] = False
    spec["tracking"] = {
        "mlflow": {"uri": mlflow_server.uri, "experiment": "temper-run"},
        "wandb": {"project": "temper-run", "mode": "offline"},
    }
    path.write_text(yaml.safe_dump(spec))
    code = main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--run-id", "tracked"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "tracking: not every event" not in err

    with sqlite3.connect(tmp_path / "runs" / "tracked" / "temper.db") as conn:
        # the job, not its evaluation jobs (jobs of their own, never tracked themselves)
        job_id, tenant, name, stored, state, recorded = conn.execute(
            "SELECT id, tenant_id, name, spec, state, provenance FROM jobs "
            "WHERE id NOT IN (SELECT job_id FROM evaluations)"
        ).fetchone()
        versions = conn.execute(
            "SELECT version, metrics FROM policy_versions WHERE job_id = ? ORDER BY version", (job_id,)
        ).fetchall()
        rewards = conn.execute(
            "SELECT iteration, reward FROM episodes WHERE job_id = ? AND state IN ('scored', 'trained') "
            "AND reward IS NOT NULL",
            (job_id,),
        ).fetchall()
        evaluated = conn.execute(
            "SELECT version, summary FROM evaluations WHERE source_job_id = ? ORDER BY version", (job_id,)
        ).fetchall()
    assert state == "completed" and len(versions) >= 2, versions
    run, history = asyncio.run(read_run(mlflow_server.uri, "temper-run", job_id))

    assert run["info"]["status"] == "FINISHED"
    logged = {**json.loads(stored), **provenance_params(json.loads(recorded))}
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params == flatten(logged)
    # the job's provenance: the run's initial model directory (temper run makes it) by digest
    assert params["provenance.model.source"] == "directory" and len(params["provenance.model.sha256"]) == 64
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert (tags["temper.tenant"], tags[JOB_TAG], tags["temper.job_name"], tags["temper.version"], tags["temper.state"]) == (
        tenant, job_id, name, __version__, "completed",
    )  # fmt: skip
    for key in NUMBERS:
        got = sorted((int(m["step"]), m["value"]) for m in history[f"train/{key}"])
        assert got == [(v, float(json.loads(m)[key])) for v, m in versions], key
    # each evaluation of a version (v0, v2, ...: the small spec's every_versions) at its version
    assert [v for v, _ in evaluated] == list(range(0, max(v for v, _ in versions) + 1, 2)), evaluated
    for key in ("pass_at_1", "pass_at_2", "reward_mean"):
        got = sorted((int(m["step"]), m["value"]) for m in history[f"eval/{key}"])
        want = []
        for v, summary in evaluated:
            results = json.loads(summary)
            value = results["pass_at"][key[-1]] if key.startswith("pass_at") else results[key]
            want.append((v, float(value)))
        assert got == want, key
    for it in sorted({i for i, _ in rewards}):
        values = [r for i, r in rewards if i == it]
        mean = sum(values) / len(values)
        std = math.sqrt(max(0.0, sum(r * r for r in values) / len(values) - mean * mean))
        for key, want in (
            ("rollout/reward_mean", mean),
            ("rollout/reward_std", std),
            ("rollout/episodes", len(values)),
        ):
            final = max((m for m in history[key] if int(m["step"]) == it), key=lambda m: m["timestamp"])
            assert final["value"] == pytest.approx(want, rel=1e-9, abs=1e-12), (key, it)

    # the same job in W&B: under the run's data directory (TEMPER_TRACKING__WANDB_DIR unset)
    files = WandbSink(tmp_path / "runs" / "tracked" / "wandb").run_files(job_id, tenant)
    assert len(files) == 1, files
    records = read_records(files[0])
    wandb_run = next(r["run"] for r in records if r["type"] == "run")
    assert (wandb_run["run_id"], wandb_run["project"], wandb_run["display_name"]) == (
        job_id,
        "temper-run",
        name,
    )
    assert f"tenant:{tenant}" in wandb_run["tags"] and f"job:{job_id}" in wandb_run["tags"]
    config = {k: v for k, v in wandb_run["config"]["update"].items() if k != "_wandb"}
    assert config == {**flatten_values(logged), "temper.tenant": tenant, "temper.job_id": job_id,
                      "temper.job_name": name, "temper.version": __version__}  # fmt: skip
    rows = wandb_history(records)
    for v, m in versions:
        [row] = [row for row in rows if row.get("policy_version") == v and "train/loss" in row]
        for key in NUMBERS:
            assert row[f"train/{key}"] == float(json.loads(m)[key]), (v, key)
            # and MLflow holds the same number
            assert [p["value"] for p in history[f"train/{key}"] if int(p["step"]) == v] == [
                row[f"train/{key}"]
            ]
    for it in sorted({i for i, _ in rewards}):
        values = [r for i, r in rewards if i == it]
        newest: dict[str, float] = {}
        for row in rows:
            if row.get("iteration") == it:
                newest.update({k: v for k, v in row.items() if k.startswith("rollout/")})
        assert newest["rollout/reward_mean"] == pytest.approx(sum(values) / len(values), rel=1e-9, abs=1e-12)
        assert newest["rollout/episodes"] == len(values)
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["temper.state"] == "completed"
    assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]
