"""Supervised warm start: a short phase of next-token training on (conversation,
completion) pairs before reinforcement learning begins. It teaches a freshly created
policy the action format so that RL starts from valid, if often wrong, actions.

The loss covers the completion's tokens only, and the prompt is encoded exactly as an
episode's first prompt is (``encode_chat``), so what the policy learns here is what it
sees in rollouts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from temper.policy import pad_batch, token_logprobs
from temper.policy.tokenizer import ByteTokenizer, encode_chat

Pair = tuple[list[dict[str, str]], str]  # (chat messages before the answer, the answer text)


@dataclass
class WarmStartStats:
    steps: int
    loss: float
    seconds: float
    tokens: int


def encode_pair(
    tok: ByteTokenizer, messages: Sequence[dict[str, str]], completion: str
) -> tuple[list[int], int]:
    """The ids of prompt + completion + ``<|end|>``, and where the completion starts."""
    prompt = encode_chat(tok, messages)
    return prompt + tok.encode(completion) + [tok.end_id], len(prompt)


def warm_start(
    model: torch.nn.Module,
    tok: ByteTokenizer,
    pairs: Sequence[Pair],
    *,
    steps: int,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmStartStats:
    """Train ``model`` in place for ``steps`` batches drawn from ``pairs`` (with replacement
    once they run out). Returns the last step's loss and the time taken."""
    if not pairs:
        raise ValueError("warm start needs at least one (messages, completion) pair")
    encoded = [encode_pair(tok, m, c) for m, c in pairs]
    rng = random.Random(seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    start, tokens, loss_value = time.perf_counter(), 0, float("nan")
    for step in range(steps):
        while len(order) < batch_size:
            fresh = list(range(len(encoded)))
            rng.shuffle(fresh)
            order.extend(fresh)
        batch = [encoded[order.pop()] for _ in range(batch_size)]
        ids, attention = pad_batch([b[0] for b in batch], tok.pad_id)
        completion = torch.zeros_like(ids)
        for row, (seq, begin) in enumerate(batch):
            completion[row, begin : len(seq)] = 1
        logprobs = token_logprobs(model, ids, attention, completion)
        count = completion.sum()
        loss = -logprobs.sum() / count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += int(count)
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    return WarmStartStats(steps=steps, loss=loss_value, seconds=time.perf_counter() - start, tokens=tokens)
