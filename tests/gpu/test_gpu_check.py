"""``make gpu-check``: each part of bench/gpu_check.py on its own. The ``gpu`` tests need
CUDA (run on a GPU node with ``pytest -m gpu --noconftest tests/gpu``: the machine's
own torch/transformers/peft, no project venv); the CPU test runs the same code on a
tiny model everywhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(120)
def test_every_part_runs_on_a_tiny_model_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    tiny = [
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--samples",
        "4",
        "--prompt-len",
        "8",
        "--completion-len",
        "8",
    ]
    assert (
        gpu_check.main([*tiny, "--steps", "1", "--gen-batch", "4", "--gen-tokens", "4", "--out", str(out)])
        == 0
    )
    figures = json.loads(out.read_text())
    for key in ("lora_train_tokens_per_s", "full_train_tokens_per_s", "generate_tokens_per_s"):
        assert figures[key] > 0
    assert "peak_memory_gb" in figures


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(360)
@pytest.mark.parametrize("part", ["lora", "full", "generate"])
def test_part_on_the_gpu(part, tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--part", part, "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    key = "generate_tokens_per_s" if part == "generate" else f"{part}_train_tokens_per_s"
    assert figures[key] > 0 and figures["peak_memory_gb"] > 0
