"""examples/tool-job.yaml, shrunk: the mechanics of a multi-turn job with tools on a
real architecture (a ChatML Qwen2 built in the run; a Llama-3-style Llama directory
named as ``policy.model``), through ``temper run``. Learning is not checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.cli import main

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def shrunk(tmp_path: Path, **policy) -> Path:
    spec = yaml.safe_load((ROOT / "examples" / "tool-job.yaml").read_text())
    spec["tasks"]["group_size"] = 4
    spec["schedule"].update(iterations=2, episodes_per_iteration=8, max_concurrent_episodes=8)
    spec["algorithm"]["groups_per_step"] = 2
    spec["evaluation"].update(samples=1, pass_at=[1])  # v0 on the held-out words, once each
    spec["policy"].update(policy)
    local = spec["local"]
    local["taskset_file"] = str(ROOT / "examples" / local["taskset_file"])
    file, _, func = local["warm_start"]["generator"].partition(":")
    local["warm_start"].update(generator=f"{ROOT / 'examples' / file}:{func}", steps=30, examples=300)
    path = tmp_path / "tool-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(tmp_path: Path, spec: Path, run_id: str, capsys) -> tuple[Path, dict]:  # noqa: ANN001
    code = main(["run", str(spec), "--runs-dir", str(tmp_path / "runs"), "--run-id", run_id])
    assert code == 0, capsys.readouterr().err[-3000:]
    run_dir = tmp_path / "runs" / run_id
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def first_prompt(run_dir: Path) -> str:
    html = (run_dir / "report.html").read_text()
    return html.split("<pre class='prompt'>", 1)[1].split("</pre>", 1)[0]


def test_the_tool_job_runs_on_a_chatml_qwen2_built_in_the_run(tmp_path, capsys):
    run_dir, summary = run(tmp_path, shrunk(tmp_path), "chatml", capsys)
    assert summary["state"] == "completed" and len(summary["reward_curve"]) == 2
    policy = run_dir / "policy-v0"
    config = json.loads((policy / "config.json").read_text())
    assert config["model_type"] == "qwen2" and (policy / "chat_template.jinja").exists()
    prompt = first_prompt(run_dir)
    assert "&lt;|im_start|&gt;system" in prompt and "&quot;name&quot;: &quot;python&quot;" in prompt


def config_dtype(directory: Path) -> str:
    return json.loads((directory / "config.json").read_text())["dtype"]


def test_a_llama_directory_with_its_own_template_runs_unchanged(tmp_path, capsys):
    import torch

    from temper.policy.build import build_model_dir, train_tokenizer

    corpus = [f"What is {a} * {b}? {a * b}" for a in range(12, 40) for b in range(12, 20)]
    tok = train_tokenizer(corpus, template="llama3", vocab_size=400)
    model_dir = build_model_dir(
        tmp_path / "llama-tiny", "llama", tok, max_shard_size="200KB", dtype=torch.bfloat16
    )
    spec = yaml.safe_load(shrunk(tmp_path, model=str(model_dir)).read_text())
    spec["environment"]["action_format"] = "llama3_json"
    spec["local"].pop("build")
    spec["local"].pop("warm_start")
    path = tmp_path / "llama-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir, summary = run(tmp_path, path, "llama", capsys)
    assert summary["state"] == "completed"
    config = json.loads((run_dir / "policy-v0" / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "&lt;|start_header_id|&gt;system" in first_prompt(run_dir)
    # a bf16 directory stays bf16 in policy-v0 (the trainer's versions: tests/libs/policy/test_model_dtype.py)
    assert config_dtype(model_dir) == config_dtype(run_dir / "policy-v0") == "bfloat16"
