"""One optimizer step on the fixed batch, on one process or under torchrun with FSDP2
(gloo): writes the loss, the gradient norm and the weights after the step to OUT.

    python tests/libs/training/fsdp_step.py OUT BUDGET                      # one process
    python -m torch.distributed.run --nproc_per_node 2 tests/libs/training/fsdp_step.py OUT BUDGET

BUDGET is the micro-batch token budget.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from temper.policy import create_model
from temper.training import Learner, LearnerConfig, samples_from_groups
from temper.training.distributed import full_norm, shard, share
from tests.libs.training.batches import fixed_batch, leave_process_group


def main(out: Path, budget: int) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    # AdamW's first step moves each weight by about lr * g / (|g| + 1e-8): for the few
    # gradient entries near 1e-8 the ranks' different summation order shows up at the
    # scale of lr (2e-5 at lr 1e-2, measured), so the test uses 1e-3
    config = LearnerConfig(learning_rate=1e-3, kl_coef=0.05, micro_batch_tokens=budget)
    learner = Learner(create_model(seed=1), config, device="cpu", reference=create_model(seed=2))
    if world > 1:
        shard(learner)
    else:
        learner.full_forward = True  # the same forward as the sharded run
    samples, _ = samples_from_groups(fixed_batch(create_model(seed=1)), objective=config.objective())
    learner.optimizer.zero_grad(set_to_none=True)
    acc = learner.backward(share(samples, rank, world), batch=samples)
    loss = torch.tensor([acc.loss])
    if world > 1:
        dist.all_reduce(loss)
    params = [p for p in learner.model.parameters() if p.grad is not None]
    grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    learner.optimizer.step()
    weights = {}
    for name, p in learner.model.named_parameters():
        full = getattr(p, "full_tensor", None)
        weights[name] = (full() if full is not None else p).detach().clone().contiguous()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "weights.safetensors"))
        (out / "step.json").write_text(
            json.dumps({"loss": float(loss), "grad_norm": grad_norm, "world": world})
        )
    if world > 1:
        leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
