"""Sharded checkpoints (torch.distributed.checkpoint) through the object store: saved by
two ranks under torchrun (gloo), restored by one process; weights and AdamW moments equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from temper.registry import read_manifest
from temper.storage import LocalStore
from tests.libs.training.test_fsdp import ROOT, run

pytestmark = pytest.mark.timeout(200)

SCRIPT = ROOT / "tests" / "libs" / "training" / "fsdp_checkpoint.py"


async def test_saved_by_two_ranks_loads_on_one(tmp_path: Path):
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(SCRIPT), "save", str(tmp_path)])  # fmt: skip
    run([sys.executable, str(SCRIPT), "load", str(tmp_path)])
    saved = json.loads((tmp_path / "saved.json").read_text())
    manifest = await read_manifest(LocalStore(tmp_path / "store"), saved["key"])
    # one shard file per rank and the metadata, each checksummed in the manifest
    assert {n for n in manifest.files if n.startswith("trainer/")} == {
        "trainer/dcp/.metadata", "trainer/dcp/__0_0.distcp", "trainer/dcp/__1_0.distcp"
    }  # fmt: skip
    assert json.loads((tmp_path / "loaded.json").read_text()) == {"step": 1, "version": 1}
    # the memory plan of a sharded learner counts this rank's shard of AdamW's state
    assert saved["plan_ranks"] == 2
    assert saved["plan_optimizer"] * 2 == saved["moments_all_ranks"]
    reference = load_file(str(tmp_path / "reference.safetensors"))
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    assert reference.keys() == loaded.keys()
    assert any(k.startswith("exp_avg_sq.") for k in reference), "AdamW's moments are compared too"
    for name, value in reference.items():
        assert torch.equal(loaded[name], value), name
    # the served weights (gathered on rank 0) are the same model
    served = load_file(str(tmp_path / "store" / Path(saved["key"]).parent / "model.safetensors"))
    for name, value in served.items():
        assert torch.equal(value, reference[f"weight.{name}"]), name
