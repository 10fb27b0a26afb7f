"""A model keeps the dtype it is stored in: a bf16 directory is loaded to compute in float32
(the CPU engine, the trainer's master weights) and written back in bf16, by the embedded
run's policy-v0 and by the trainer's full versions; a float32 one stays float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from temper.policy import create_model, default_tokenizer, load_model, save_checkpoint, stored_dtype
from temper.training import Learner, LearnerConfig

pytestmark = pytest.mark.timeout(60)

TOK = default_tokenizer()


def stored(directory: Path) -> tuple[str, set[torch.dtype]]:
    """The config's dtype and the dtypes of the tensors in the directory's weights."""
    config = json.loads((directory / "config.json").read_text())
    dtypes = set()
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as weights:
            dtypes |= {weights.get_tensor(k).dtype for k in weights.keys()}  # noqa: SIM118
    return config["dtype"], dtypes


def test_a_bf16_directory_is_trained_in_float32_and_written_back_in_bf16(tmp_path: Path) -> None:
    save_checkpoint(create_model(seed=1).to(torch.bfloat16), tmp_path / "bf16", tokenizer=TOK)
    assert stored(tmp_path / "bf16") == ("bfloat16", {torch.bfloat16})
    model, _ = load_model(tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.float32 and stored_dtype(model) == torch.bfloat16
    save_checkpoint(model, tmp_path / "again", tokenizer=TOK)
    assert stored(tmp_path / "again") == ("bfloat16", {torch.bfloat16})
    back, _ = load_model(tmp_path / "again")
    for a, b in zip(model.parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b), "bf16 values survive float32 and back exactly"

    # the trainer's full versions (Learner.export_version) too
    learner = Learner(model, LearnerConfig(), device="cpu")
    learner.export_version(tmp_path / "v1", tokenizer=TOK)
    assert stored(tmp_path / "v1") == ("bfloat16", {torch.bfloat16})


def test_a_float32_model_stays_float32(tmp_path: Path) -> None:
    save_checkpoint(create_model(seed=1), tmp_path / "f32", tokenizer=TOK)
    model, _ = load_model(tmp_path / "f32")
    assert stored_dtype(model) == torch.float32
    save_checkpoint(model, tmp_path / "again", tokenizer=TOK)
    assert stored(tmp_path / "again") == ("float32", {torch.float32})


def test_a_config_naming_no_float_dtype_is_refused(tmp_path: Path) -> None:
    save_checkpoint(create_model(seed=1), tmp_path / "m", tokenizer=TOK)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "dtype": "int8"}))
    with pytest.raises(ValueError, match="int8"):
        stored_dtype(tmp_path / "m")


async def test_the_trainer_publishes_a_bf16_jobs_full_versions_in_bf16(tmp_path: Path) -> None:
    """The trainer's own path: its learner built from the job's ``policy.init`` directory."""
    from services.trainer.learners import build_learner, publish_tokenizer
    from temper.jobspec import JobSpec
    from temper.settings.trainer import TrainerSettings
    from temper.storage import LocalStore

    save_checkpoint(create_model(seed=1).to(torch.bfloat16), tmp_path / "bf16", tokenizer=TOK)
    spec = JobSpec.model_validate(
        {
            "name": "bf16",
            "policy": {"model": "tiny", "init": str(tmp_path / "bf16")},
            "tasks": {"taskset": "ts"},
        }
    )
    store = LocalStore(tmp_path / "objects")
    learner = await build_learner(spec, TrainerSettings(), store, torch.device("cpu"), None)
    assert next(learner.model.parameters()).dtype == torch.float32
    key = await learner.publish_version(
        store, "v/1", job_id="j", version=1, base_model="tiny", tokenizer=publish_tokenizer(spec)
    )
    assert key.startswith("v/1")
    assert stored(tmp_path / "objects" / "v" / "1") == ("bfloat16", {torch.bfloat16})
