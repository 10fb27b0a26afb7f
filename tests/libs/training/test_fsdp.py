"""FSDP2 under torchrun with gloo: two processes make the same step as one (loss,
gradient norm and every weight after the AdamW step, within 1e-5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from temper.policy import create_model

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "libs" / "training" / "fsdp_step.py"


def run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    # its own session, so that a hung run is killed with its worker processes
    proc = subprocess.Popen(
        args,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]


def test_two_ranks_make_the_same_step_as_one(tmp_path):
    # one process, one micro-batch; two ranks with a budget that gives them 2 and 1 micro-batches
    run([sys.executable, str(SCRIPT), str(tmp_path / "one"), str(1 << 20)])
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(SCRIPT), str(tmp_path / "two"), "108"])  # fmt: skip
    one = json.loads((tmp_path / "one" / "step.json").read_text())
    two = json.loads((tmp_path / "two" / "step.json").read_text())
    assert (one["world"], two["world"]) == (1, 2)
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)
    w1 = load_file(str(tmp_path / "one" / "weights.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "weights.safetensors"))
    assert w1.keys() == w2.keys()
    for name, w in w1.items():
        assert torch.allclose(w2[name], w, atol=1e-5, rtol=0), name
    initial = dict(create_model(seed=1).named_parameters())
    assert all(not torch.equal(w1[n], initial[n].detach()) for n in w1), "the step moved every weight"


def test_what_a_sharded_learner_refuses_is_said_before_any_collective():
    from temper.jobspec import LoraSpec
    from temper.training import Learner, LearnerConfig
    from temper.training.distributed import shard

    lora = Learner(create_model(seed=1), LearnerConfig(lora=LoraSpec(rank=4, alpha=8)), device="cpu")
    with pytest.raises(ValueError, match="LoRA on a sharded model is not built"):
        shard(lora)  # no process group: it must fail before needing one
    entropy = Learner(create_model(seed=1), LearnerConfig(entropy_coef=0.01), device="cpu")
    with pytest.raises(ValueError, match="entropy bonus"):
        shard(entropy)
