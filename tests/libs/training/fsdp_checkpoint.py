"""A sharded checkpoint through the object store (a local directory store here):

    python -m torch.distributed.run --nproc_per_node 2 tests/libs/training/fsdp_checkpoint.py save OUT
    python tests/libs/training/fsdp_checkpoint.py load OUT

``save``: two ranks shard the tiny model, make one step on the fixed batch and publish
version 1 (gathered weights for servers, DCP state per rank); rank 0 also writes the
whole weights and AdamW moments as ``reference.safetensors``. ``load``: one process,
no process group, starts from other weights, restores version 1 and writes what it
holds as ``loaded.safetensors`` (and its step in ``loaded.json``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from temper.policy import create_model
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig
from temper.training.distributed import full_weights, shard
from tests.libs.training.batches import fixed_batch, leave_process_group

PREFIX = "tenants/t/jobs/j/versions/v1"
CONFIG = LearnerConfig(learning_rate=1e-3, micro_batch_tokens=108)


def everything(learner: Learner, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments by parameter name (full tensors; collective when sharded)."""
    optim = get_optimizer_state_dict(
        learner.model, learner.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = {f"weight.{k}": v.clone().contiguous() for k, v in weights.items()}
    for name, state in optim.get("state", {}).items():
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{moment}.{name}"] = state[moment].clone().contiguous()
    return out


async def save(out: Path) -> None:
    dist.init_process_group("gloo")
    learner = Learner(create_model(seed=1), CONFIG, device="cpu")
    shard(learner)
    stats = learner.step(fixed_batch(create_model(seed=1)))
    assert stats.updated, stats
    key = await learner.publish_version(
        LocalStore(out / "store"), PREFIX, job_id="j", version=1, base_model="tiny"
    )
    state = everything(learner, full_weights(learner))
    # AdamW's moments this rank holds (its shards), added over the ranks
    held = [t.to_local() for s in learner.optimizer.state.values() for k, t in s.items() if k != "step"]
    moments = torch.tensor([float(sum(t.numel() * t.element_size() for t in held))], dtype=torch.float64)
    dist.all_reduce(moments)
    if dist.get_rank() == 0:
        save_file(state, str(out / "reference.safetensors"))
        plan = learner.memory_plan
        (out / "saved.json").write_text(
            json.dumps(
                {"key": key, "step": learner.step_count, "plan_ranks": plan.ranks,
                 "plan_optimizer": plan.optimizer, "moments_all_ranks": int(moments)}
            )
        )  # fmt: skip
    leave_process_group()


async def load(out: Path) -> None:
    key = json.loads((out / "saved.json").read_text())["key"]
    learner = Learner(create_model(seed=3), CONFIG, device="cpu")
    await learner.load_version(LocalStore(out / "store"), key)
    weights = {k: v.detach() for k, v in learner.model.state_dict().items()}
    save_file(everything(learner, weights), str(out / "loaded.safetensors"))
    (out / "loaded.json").write_text(json.dumps({"step": learner.step_count, "version": learner.version}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mode, out = sys.argv[1], Path(sys.argv[2])
    asyncio.run(save(out) if mode == "save" else load(out))
