"""Supervised warm start: a short phase of next-token training on teacher
conversations before reinforcement learning begins. It teaches a freshly created
policy the action format so that RL starts from valid, if often wrong, actions.

A conversation is encoded exactly as an episode grows (the chat template's first
prompt, then per turn the assistant's ids, the template's end-of-turn, the observation
message and the next assistant header), so what the policy learns here is what it
sees in rollouts. The loss covers the assistant's tokens (and the first end-of-turn
token, where generation stops) only.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from temper.policy import pad_batch, token_logprobs
from temper.policy.tokenizer import ChatTokenizer

# (chat messages before the answer, the answer text) or, for several turns,
# (messages, [reply 1, observation 1, reply 2, ...]) ending with a reply.
Pair = tuple[list[dict[str, str]], str | list[str]]


@dataclass
class WarmStartStats:
    steps: int
    loss: float
    seconds: float
    tokens: int


def encode_conversation(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    turns: str | Sequence[str],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    observation_role: str = "tool",
) -> tuple[list[int], list[bool]]:
    """Ids of the conversation and a mask that is True on the assistant's own tokens."""
    parts = [turns] if isinstance(turns, str) else list(turns)
    if len(parts) % 2 == 0:
        raise ValueError("turns alternate reply, observation, reply ...; they must end with a reply")
    ids = tok.render(messages, tools=tools)
    mask = [False] * len(ids)
    stop = tok.end_of_turn_ids[:1]
    for i, text in enumerate(parts):
        if i % 2 == 0:
            reply = tok.encode(text) + stop
            ids += reply
            mask += [True] * len(reply)
        else:
            more = tok.continuation(ids, [{"role": observation_role, "content": text}], tools=tools)
            ids += more
            mask += [False] * len(more)
    return ids, mask


def encode_pair(
    tok: ChatTokenizer, messages: Sequence[dict[str, str]], completion: str
) -> tuple[list[int], int]:
    """The ids of prompt + completion + the end-of-turn token, and where the completion starts."""
    ids, mask = encode_conversation(tok, messages, completion)
    return ids, mask.index(True)


def warm_start(
    model: torch.nn.Module,
    tok: ChatTokenizer,
    pairs: Sequence[Pair],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
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
    encoded = [encode_conversation(tok, m, c, tools=tools) for m, c in pairs]
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
        for row, (seq, mask) in enumerate(batch):
            completion[row, : len(seq)] = torch.tensor(mask, dtype=completion.dtype)
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
