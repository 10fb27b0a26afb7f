"""A fixed batch for the objective and memory tests, a plain (numpy) logprob reference, and
the way a torchrun test script's rank ends."""

from __future__ import annotations

import math
import os
import random
import sys

import numpy as np
import torch

from temper.policy import default_tokenizer, encode_chat
from temper.trajectory import Segment, Trajectory


def plain(model, ids: list[int]) -> tuple[list[float], list[float]]:
    """log p(ids[t] | ids[:t]) and the entropy of that distribution, for t >= 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    lp, ent = [0.0], [0.0]
    for t in range(1, len(ids)):
        row = logits[t - 1]
        m = row.max()
        logp = row - (m + math.log(np.exp(row - m).sum()))
        lp.append(float(logp[ids[t]]))
        ent.append(float(-(np.exp(logp) * logp).sum()))
    return lp, ent


def fixed_batch(policy, seed: int = 5) -> list[list[Trajectory]]:
    """Two groups of four; model turns of 3 to 12 tokens, so the overlong settings below
    cut through the batch; behaviour logprobs are the policy's own plus noise."""
    rng = random.Random(seed)
    tok = default_tokenizer()
    groups = []
    for g, rewards in enumerate([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.4]]):
        group = []
        for i, r in enumerate(rewards):
            prompt = encode_chat(tok, [{"role": "user", "content": f"task {g}: " + "y" * rng.randint(1, 5)}])
            answer = [rng.randrange(32, 127) for _ in range(2 + 3 * i + g)] + [tok.stop_ids[0]]
            ids = prompt + answer
            lp, _ = plain(policy, ids)
            noisy = [x + rng.uniform(-0.7, 0.7) for x in lp[len(prompt) :]]
            segments = [
                Segment(role="prompt", token_ids=prompt),
                Segment(role="model", token_ids=answer, logprobs=noisy, policy_version=0),
            ]
            group.append(
                Trajectory(
                    job_id="j",
                    episode_id=f"e{g}{i}",
                    task_id=f"t{g}",
                    group_id=f"g{g}",
                    segments=segments,
                    reward=r,
                )  # fmt: skip
            )
        groups.append(group)
    return groups


def leave_process_group() -> None:
    """End a gloo rank of a test script: wait for every rank, then exit without tearing
    the group down. A rank sometimes aborted after its results were written ("terminate
    called without an active exception": 1 run in 100 here, once in CI), in
    ``destroy_process_group`` or in the interpreter's finalization with gloo's threads
    alive; os._exit skips both."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
