"""``make gpu-check`` (bench/gpu_check.py) on a CPU: every part's code on a tiny model, so
the check cannot rot between GPU sessions; the MFU count against a hand count; the
peaks by device name; the plan against the device budget. On a GPU machine the check
itself is ``make gpu-check`` (the full-size parts, with the machine's own packages and
the wheels of scripts/gpu_wheels.sh)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

# Distributions of a GPU machine's own image that Temper's code imports (the image's
# package list, read 2026-11-17, has these among many); everything else it imports must
# be among the wheels scripts/gpu_wheels.sh carries.
IMAGE = {"torch", "transformers", "peft", "safetensors", "tokenizers", "numpy", "pyyaml", "prometheus-client"}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


SPY = """
import builtins, json, sys
from importlib.metadata import packages_distributions
seen, real = set(), builtins.__import__
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and ((globals or {}).get("__name__") or "").split(".")[0] in ("temper", "services", "gpu_check"):
        seen.add(name.split(".")[0])
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = spy
sys.path.insert(0, "bench")
import gpu_check
code = gpu_check.main(json.loads(sys.argv[1]))
dists = packages_distributions()
print(json.dumps(sorted({d for m in seen - set(sys.stdlib_module_names) for d in dists.get(m, [m])})))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Every part on the tiny model on the CPU, in a process of its own that also records
    which distributions Temper's code imports (module-level and in the parts' functions)."""
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}{os.pathsep}{ROOT}"}
    args = ["--size", "tiny", "--device", "cpu", "--tflops", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", SPY, json.dumps(args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,  # about 20 CPU-seconds; the shared machine runs it 2-5 times slower
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    return lines[:-1], json.loads(out.read_text()), {normal(d) for d in json.loads(lines[-1])} - {"temper"}


@pytest.mark.timeout(240)
def test_every_part_runs_on_a_tiny_model_on_the_cpu(tiny_run):
    lines, f, _ = tiny_run
    assert [line.split(":")[0] for line in lines] == ["learner", "engine", "fsdp"], "in order of value"
    assert all(line.endswith(" ok") for line in lines), lines
    assert not [k for k, v in f.items() if isinstance(v, (dict, list))], "a flat object, like every result"
    assert (f["learner_ok"], f["engine_ok"], f["fsdp_ok"]) == (True, True, True)
    for name in ("learner_full", "learner_lora"):
        assert f[f"{name}_tokens_per_s"] > 0 and f[f"{name}_steps"] == 2
        assert f[f"{name}_micro_batches"] >= 2, "the token budget splits each step"
        # the MFU over the stated peak is the model FLOPs rate over it
        assert f[f"{name}_mfu"] == pytest.approx(f[f"{name}_model_tflops"] / 2)
        # the live tensors of the steps, measured, against the learner's own memory model
        assert f[f"{name}_peak_gib"] > 0
        assert abs(f[f"{name}_estimate_error"]) <= gpu_check.MEMORY_TOLERANCE
        assert f[f"{name}_plan_gib"] >= f[f"{name}_peak_gib"], "the learner plans for the worst case"
    assert f["learner_lora_trainable"] < f["learner_full_trainable"] / 4
    # every row's logprobs are its own adapter's (fp32 here), and the adapters differ
    assert f["engine_rows"] == 6 and f["engine_tokens_per_s"] > 0
    assert f["engine_logprob_max_abs_diff"] < 1e-4
    assert f["engine_other_adapter_mean_abs_diff"] > 100 * max(f["engine_logprob_mean_abs_diff"], 1e-6)
    # two gloo ranks under torchrun make the steps of one process
    assert f["fsdp_ranks"] == 2 and f["fsdp_steps"] == 3
    assert f["fsdp_loss_max_rel_diff"] < 1e-4 and f["fsdp_tokens_per_s_per_rank"] > 0


def test_model_flops_are_the_hand_count_of_a_tiny_config():
    a = gpu_check.Arch(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512)
    # head size 16: q and o are 64 x 64, k and v 64 x 32, gate, up and down 64 x 128
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert per_layer == 36_864
    assert gpu_check.decoder_weights(a) == 2 * per_layer == 73_728
    # a sample of 10 tokens, 4 of them scored:
    #   decoder  2 x 73,728 x 10                                  = 1,474,560
    #   output   2 x 64 x 512 x 4                                 =   262,144
    #   attention: 10 x 11 / 2 = 55 causal pairs, 4 heads x (2 x 16 for the score
    #   + 2 x 16 for the value) = 256 FLOPs a pair, 2 layers: 55 x 256 x 2 = 28,160
    f = 1_474_560 + 262_144 + 28_160
    assert gpu_check.forward_flops(a, 10, 4) == f == 1_764_864
    assert gpu_check.step_flops(a, [(10, 4)]) == 3 * f == 5_294_592
    # a second sample of 3 tokens, 1 scored: 442,368 + 65,536 + 6 pairs x 256 x 2 = 3,072
    f2 = 2 * 73_728 * 3 + 2 * 64 * 512 * 1 + 3_072
    assert gpu_check.step_flops(a, [(10, 4), (3, 1)]) == 3 * (f + f2) == 6_827_520
    # LoRA: forward, input gradients (once more the forward), attention's backward (twice its
    # forward: once more on top), and 6 FLOPs a token for each of the adapter's 1,000 weights
    lora = 2 * f + 28_160 + 6 * 1_000 * 10
    assert gpu_check.step_flops(a, [(10, 4)], lora_weights=1_000) == lora == 3_617_888
    assert gpu_check.step_flops(a, [(10, 4)], lora_weights=1_000, reference=True) == lora + f
    assert gpu_check.mfu(5e14, 2.0, 1000.0) == pytest.approx(0.25)


def test_the_counted_weights_are_the_models_own():
    a = gpu_check.SIZES["tiny"].arch
    model = gpu_check.build_model(a, device=torch.device("cpu"))
    layers = model.get_decoder().layers
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    assert gpu_check.decoder_weights(a) == linear
    assert model.get_output_embeddings().weight.numel() == a.hidden * a.vocab


def test_the_1_5b_shape_is_qwen2_5_1_5b():
    a = gpu_check.QWEN25_1_5B
    assert (a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab) == (
        28,
        1536,
        12,
        2,
        8960,
        151936,
    )
    # 1.54B parameters with tied embeddings (norms and biases aside)
    assert math.isclose(gpu_check.decoder_weights(a) + a.hidden * a.vocab, 1.54e9, rel_tol=0.01)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", 989.5),
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L4", 121.0),
        ("Tesla T4", None),
    ],
)
def test_the_peak_is_read_from_the_device_name(name, tflops):
    assert gpu_check.peak_tflops(name) == tflops


def test_the_plan_fits_the_device_budget():
    # python -S: no site-packages, so the plan needs the standard library alone (no torch, no pydantic)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-S", "bench/gpu_check.py", "--plan"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    minutes = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in (*gpu_check.PARTS, "total"):
            minutes[words[0]] = float(words[1])
    assert set(minutes) == {*gpu_check.PARTS, "total"}
    assert all(0 < minutes[p] <= 4 for p in gpu_check.PARTS)
    assert minutes["total"] <= gpu_check.DEVICE_BUDGET_MIN - gpu_check.MACHINE_START_MIN
    assert "fits: yes" in text


def test_fsdp_is_skipped_with_the_reason_on_one_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    got = gpu_check.fsdp_part(gpu_check.SIZES["tiny"], torch.device("cuda"), None)  # type: ignore[arg-type]
    assert got.failed == [] and got.figures == {
        "fsdp_skipped": "1 GPU visible: FSDP2 on NCCL needs 2 or more"
    }
    assert got.line == "skipped: 1 GPU visible: FSDP2 on NCCL needs 2 or more"


@pytest.mark.timeout(60)
def test_a_failed_check_exits_non_zero_and_keeps_the_figures(monkeypatch, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"engine_tokens_per_s": 12.5}))  # an earlier part's figures stay
    monkeypatch.setattr(gpu_check, "MEMORY_TOLERANCE", -1.0)  # no estimate can pass
    monkeypatch.setitem(gpu_check.SIZES, "tiny", gpu_check.replace(gpu_check.SIZES["tiny"], steps=1))
    assert gpu_check.main(["--part", "learner", "--size", "tiny", "--device", "cpu", "--out", str(out)]) == 1
    f = json.loads(out.read_text())
    assert f["learner_ok"] is False and "off the peak" in f["learner_failed"]
    assert f["learner_full_tokens_per_s"] > 0 and f["learner_lora_tokens_per_s"] > 0
    assert f["engine_tokens_per_s"] == 12.5
    assert "learner: " in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_the_check_imports_only_what_a_gpu_machine_has_or_is_carried(tiny_run):
    imported = tiny_run[2]
    script = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    carried = {normal(n) for n in re.search(r"NAMES=\(([^)]*)\)", script).group(1).split()}
    assert {"torch", "transformers", "peft", "pydantic", "minio"} <= imported, (
        f"the spy sees the imports: {imported}"
    )
    assert imported - IMAGE - carried == set(), (
        "add it to scripts/gpu_wheels.sh (or IMAGE, if the image has it)"
    )
    assert {normal(n) for n in gpu_check.CARRIED} <= carried
