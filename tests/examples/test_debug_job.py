"""examples/debug-job.yaml, shrunk: the mechanics of the debugging job through ``temper run``
(a ChatML Qwen2 built and warm-started in the run, the module and its tests only named in
the prompt, the tests run and the file edited in the sandbox by the job's own tools,
hidden tests grading the workspace, partial rollouts with every token's version on its
trajectory). Learning is not checked here: the full example's figures are in the README."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
import yaml

from services.cli import main
from temper.trajectory import Trajectory

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def shrunk(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples" / "debug-job.yaml").read_text())
    spec["tasks"]["group_size"] = 4
    spec["schedule"].update(iterations=2, episodes_per_iteration=8, max_concurrent_episodes=8)
    spec["algorithm"]["groups_per_step"] = 1  # a version every group: episodes in flight span versions
    local = spec["local"]
    local["taskset_file"] = str(ROOT / "examples" / local["taskset_file"])
    file, _, func = local["warm_start"]["generator"].partition(":")
    local["warm_start"].update(generator=f"{ROOT / 'examples' / file}:{func}", steps=30, examples=300)
    path = tmp_path / "debug-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_debug_job_runs_its_tools_in_the_sandbox_with_partial_rollouts(tmp_path, capsys):
    code = main(["run", str(shrunk(tmp_path)), "--runs-dir", str(tmp_path / "runs"), "--run-id", "debug"])
    assert code == 0, capsys.readouterr().err[-3000:]
    run_dir = tmp_path / "runs" / "debug"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "completed" and len(summary["reward_curve"]) == 2
    found = sorted((run_dir / "objects").glob("tenants/*/jobs/*/trajectories/*.json"))
    trajectories = [Trajectory.model_validate_json(p.read_text()) for p in found]
    assert len(trajectories) == 16  # two iterations of eight episodes
    prompt = trajectories[0].segments[0].text
    named = re.search(r"--- (?!test_)(\w+)\.py \(not shown\)", prompt)  # listed in name order
    assert named is not None, prompt[:2000]
    assert f"--- test_{named.group(1)}.py (not shown)" in prompt
    assert "def " not in prompt and "CASES" not in prompt, (
        "neither the module nor its tests are in the prompt"
    )
    for t in trajectories:
        for seg in t.segments:
            if seg.role == "model":
                assert seg.token_versions is not None and len(seg.token_versions) == len(seg.token_ids)
                assert seg.policy_version == seg.token_versions[-1]
    with sqlite3.connect(run_dir / "temper.db") as db:
        switches = db.execute("SELECT partial_rollouts, count(*) FROM episodes GROUP BY 1").fetchall()
    assert switches == [(1, 16)], "every episode of the job takes partial rollouts"
    # whatever the barely warm policy called, the job's tools ran in the sandbox: the runner
    # of the tests printed its summary, or the edit tool its count, or a call was refused
    observed = "\n".join(turn.observation for t in trajectories for turn in t.turns)
    assert any(s in observed for s in (" passed", " replaced", "Error:")), observed[:2000]
