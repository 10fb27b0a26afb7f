"""examples/sft-job.yaml through ``temper run``, shrunk to 3 epochs: it completes, publishes
a version each epoch, and summary.json carries the loss of the first and last version,
falling; the data file is what its generator writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_the_sft_example_completes_and_its_loss_falls(tmp_path, capsys):
    spec = yaml.safe_load((ROOT / "examples" / "sft-job.yaml").read_text())
    spec["schedule"]["iterations"] = 3
    spec["local"]["taskset_file"] = str(ROOT / "examples" / spec["local"]["taskset_file"])
    path = tmp_path / "sft-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--run-id", "sft"])
    assert code == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((tmp_path / "runs" / "sft" / "summary.json").read_text())
    assert summary["state"] == "completed" and summary["policy_version"] == 3
    assert [v["step"] for v in summary["training"]["versions"]] == [4, 8, 12]
    assert summary["last_loss"] < summary["first_loss"] * 0.8, summary
    assert "sft loss" in capsys.readouterr().err


def test_the_example_data_is_what_its_generator_writes(tmp_path):
    data = ROOT / "examples" / "tasksets" / "tool-conversations.jsonl"
    before = data.read_text()
    subprocess.run([sys.executable, str(data.with_name("make_sft_conversations.py"))], check=True)
    assert data.read_text() == before
