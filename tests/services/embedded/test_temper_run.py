"""`temper run` end to end on a small version of the example job: every service in one
process, real sandboxes, real generation, real gradient steps."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from services.cli import main

ROOT = Path(__file__).resolve().parents[3]


def small_spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples" / "code-job.yaml").read_text())
    spec["tasks"]["group_size"] = 4
    spec["schedule"].update(iterations=2, episodes_per_iteration=8, max_concurrent_episodes=8)
    spec["algorithm"]["groups_per_step"] = 2
    spec["evaluation"].update(every_versions=2, samples=2, pass_at=[1, 2])
    local = spec["local"]
    local["taskset_file"] = str(ROOT / "examples" / local["taskset_file"])
    file, _, func = local["warm_start"]["generator"].partition(":")
    local["warm_start"].update(generator=f"{ROOT / 'examples' / file}:{func}", steps=40, examples=400)
    path = tmp_path / "small-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_temper_run_completes_and_writes_the_report(tmp_path, capsys):
    code = main(["run", str(small_spec(tmp_path)), "--runs-dir", str(tmp_path / "runs"), "--run-id", "small"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    run = tmp_path / "runs" / "small"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "completed"
    assert [c["iteration"] for c in summary["reward_curve"]] == [0, 1]
    assert all(c["episodes"] == 8 for c in summary["reward_curve"]), (summary["reward_curve"], err[-3000:])
    assert {"first_mean_reward", "last_mean_reward"} <= summary.keys()
    # the trainer's own numbers per version (entropy measured): the example steps on every
    # groups_per_step groups, flat ones included (skip_zero_variance: false), so 2 iterations
    # of 2 groups make 2 versions, none older than max_staleness, and nothing is skipped
    training = summary["training"]
    assert [v["version"] for v in training["versions"]] == [1, 2], training
    assert all(v["entropy"] > 0 and v["loss"] is not None for v in training["versions"]), training
    assert training["skipped_groups"] == {} and training["not_trained_reason"] is None, training
    assert (
        summary["episodes_by_state"].get("trained", 0) + summary["episodes_by_state"].get("scored", 0) == 16
    )
    # the real reward scorer and the dispatcher both saw every episode: each counts once
    with sqlite3.connect(run / "temper.db") as conn:
        job = conn.execute("SELECT DISTINCT source_job_id FROM evaluations").fetchone()[0]
        outcomes = conn.execute("SELECT count(*), count(DISTINCT episode_id) FROM task_outcomes").fetchone()
        scored = conn.execute(
            "SELECT count(*) FROM episodes WHERE job_id = ? AND state IN ('scored', 'trained')", (job,)
        ).fetchone()
        held = {r[0] for r in conn.execute("SELECT id FROM tasks WHERE split = 'held_out'")}
        trained_on = {r[0] for r in conn.execute("SELECT task_id FROM episodes WHERE job_id = ?", (job,))}
        evaluated = conn.execute(
            "SELECT e.version, count(o.episode_id), group_concat(DISTINCT o.task_id) FROM evaluations e "
            "JOIN evaluation_outcomes o ON o.job_id = e.job_id GROUP BY e.job_id ORDER BY e.version"
        ).fetchall()
        behaviour = conn.execute(
            "SELECT DISTINCT ep.behaviour_version, e.version FROM episodes ep JOIN evaluations e ON e.job_id = ep.job_id"
        ).fetchall()
    assert outcomes == (16, 16) and scored == (16,)  # evaluation episodes are no training outcome
    # 3 of the 9 tasks held out: never trained on; each due version (v0, v2) evaluated on them, 2 samples each
    assert len(held) == 3 and not held & trained_on
    assert [v for v, _, _ in evaluated] == list(range(0, summary["policy_version"] + 1, 2))
    assert all(n == 6 and set(tasks.split(",")) == held for _, n, tasks in evaluated), evaluated
    assert all(b == v for b, v in behaviour), behaviour
    assert [e["version"] for e in summary["evaluations"]] == [v for v, _, _ in evaluated]
    assert all(set(e["pass_at"]) == {"1", "2"} for e in summary["evaluations"]), summary["evaluations"]
    png = (run / "reward_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    html = (run / "report.html").read_text()
    # (40 warm-start steps teach little, so what the model wrote is not checked here;
    # tests/services/dispatcher/test_console_real_job.py trains long enough to check it)
    assert 'id="reward-curve"' in html and "reward vector" in html and "<h4>turn 1</h4>" in html
    assert 'id="eval-curve"' in html and "<h2>Provenance</h2>" in html and "Per task at v" in html
    assert "eval pass@1" in err, "the run's last line has the evaluation"
    assert "mean reward" in err, "progress was shown"


def test_temper_run_names_a_bad_field(tmp_path, capsys):
    spec = yaml.safe_load((ROOT / "examples" / "code-job.yaml").read_text())
    spec["schedule"]["iterations"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path), "--runs-dir", str(tmp_path)]) == 2
    assert "schedule.iterations" in capsys.readouterr().err


def test_temper_run_refuses_a_run_directory_that_exists(tmp_path, capsys):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    (tmp_path / "runs" / "taken" / "temper.db").write_bytes(b"another run's")
    spec = ROOT / "examples" / "code-job.yaml"
    assert main(["run", str(spec), "--runs-dir", str(tmp_path / "runs"), "--run-id", "taken"]) == 2
    assert "exists already; give another --run-id" in capsys.readouterr().err
    assert (tmp_path / "runs" / "taken" / "temper.db").read_bytes() == b"another run's"


def test_temper_run_names_an_unknown_event_loop_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TEMPER_EVENT_LOOP", "trio")
    spec = ROOT / "examples" / "code-job.yaml"
    assert main(["run", str(spec), "--runs-dir", str(tmp_path / "runs"), "--run-id", "loop"]) == 2
    assert capsys.readouterr().err == "error: TEMPER_EVENT_LOOP='trio': expected one of uvloop, asyncio\n"
    assert not (tmp_path / "runs" / "loop").exists()  # refused before anything ran


def test_temper_run_refuses_an_environment_that_is_not_installed(tmp_path, capsys):
    spec = yaml.safe_load((ROOT / "examples" / "code-job.yaml").read_text())
    spec["environment"]["kind"] = "browser"
    path = tmp_path / "browser.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path), "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        "environment.kind" in err
        and "installed: agent (temper), code (temper), math (temper), shell (temper)" in err
    )


@pytest.mark.parametrize("betas", [[0.9, 1.0], [0.9], "fast"])
def test_temper_run_refuses_warm_start_betas_adamw_cannot_use(tmp_path, capsys, betas):
    spec = yaml.safe_load((ROOT / "examples" / "tool-job.yaml").read_text())
    spec["local"]["warm_start"]["betas"] = betas
    spec["local"]["taskset_file"] = str(ROOT / "examples" / spec["local"]["taskset_file"])
    path = tmp_path / "betas.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path), "--runs-dir", str(tmp_path)]) == 2
    assert "local.warm_start.betas" in capsys.readouterr().err
