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

from temper.envs.tools import call_id
from temper.policy import pad_batch, token_logprobs
from temper.policy.tokenizer import ChatTokenizer

# (chat messages before the answer, the answer text) or, for several turns,
# (messages, [reply 1, observation 1, reply 2, ...]) ending with a reply. A reply may be
# {"content": text, "train": False}: it stays in the conversation, the loss skips it (a
# teacher turn shown as context, so that the turns after it carry the whole loss).
Turn = str | Mapping[str, Any]
Pair = tuple[list[dict[str, str]], Turn | list[Turn]]


def turn_text(turn: Turn) -> str:
    """The text of a reply or observation, given as a string or as ``{"content": ...}``."""
    if isinstance(turn, str):
        return turn
    content = turn.get("content")
    if not isinstance(content, str):
        raise ValueError(f"a turn given as a mapping needs a string 'content', got {turn!r:.80}")
    return content


def _trained(turn: Turn) -> bool:
    if isinstance(turn, str):
        return True
    train = turn.get("train", True)
    if not isinstance(train, bool):
        raise ValueError(f"a turn's 'train' must be true or false, got {train!r}")
    return train


@dataclass
class WarmStartStats:
    steps: int
    loss: float
    seconds: float
    tokens: int


def encode_conversation(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    turns: Turn | Sequence[Turn],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    observation_role: str = "tool",
) -> tuple[list[int], list[bool]]:
    """Ids of the conversation and a mask that is True on the assistant's own tokens
    (those of the replies the loss covers)."""
    parts = [turns] if isinstance(turns, str | Mapping) else list(turns)
    if len(parts) % 2 == 0:
        raise ValueError("turns alternate reply, observation, reply ...; they must end with a reply")
    ids = tok.render(messages, tools=tools)
    mask = [False] * len(ids)
    stop = tok.end_of_turn_ids[:1]
    for i, turn in enumerate(parts):
        text = turn_text(turn)
        if i % 2 == 0:
            reply = tok.encode(text) + stop
            ids += reply
            mask += [_trained(turn)] * len(reply)
        else:
            message: dict[str, Any] = {"role": observation_role, "content": text}
            if observation_role == "tool":  # templates that check ids (Mistral's) need one
                message["tool_call_id"] = call_id(",".join(map(str, ids[-64:])), i)
            more = tok.continuation(ids, [message], tools=tools)
            ids += more
            mask += [False] * len(more)
    if not any(mask):
        raise ValueError("a warm-start conversation needs at least one reply the loss covers")
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
    betas: tuple[float, float] = (0.9, 0.999),
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    observation_role: str = "tool",
) -> WarmStartStats:
    """Train ``model`` in place for ``steps`` batches drawn from ``pairs`` (with replacement
    once they run out). Returns the last step's loss and the time taken.

    ``betas`` are AdamW's. A shorter second-moment memory (0.99) matters where a few
    tokens that need attention (an answer copied from a tool's output) share the loss with
    many easy ones (the call's fixed JSON): the easy tokens' large early gradients keep
    the step for the hard ones small for thousands of steps at 0.999."""
    if not pairs:
        raise ValueError("warm start needs at least one (messages, completion) pair")
    encoded = [
        encode_conversation(tok, m, c, tools=tools, observation_role=observation_role) for m, c in pairs
    ]
    rng = random.Random(seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=betas)
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


# --- sft jobs: conversations in the OpenAI chat format ------------------------------------

_CONTEXT = [{"role": "user", "content": "x"}]


def reply_text(
    tok: ChatTokenizer, message: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """What the model writes for an assistant ``message``: the template's rendering of it
    between the assistant header and the end of the turn (its content, and its
    ``tool_calls`` as the template writes calls, e.g. ``<tool_call>{...}</tool_call>``)."""
    head = tok.render_text(_CONTEXT, tools=tools, add_generation_prompt=True)
    full = tok.render_text([*_CONTEXT, dict(message)], tools=tools, add_generation_prompt=False)
    eot = tok.end_of_turn_text
    if not full.startswith(head) or not full.endswith(eot):
        raise ValueError(
            "the chat template renders an assistant message other than as header + reply + end of turn; "
            "its replies cannot be trained token-wise"
        )
    return full[len(head) : len(full) - len(eot)]


def encode_chat(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    trained: Sequence[bool],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """Ids of a whole conversation, grown as an episode grows (the first prompt, then per
    assistant turn the reply's ids and the first end-of-turn token, then the template's
    continuation with the messages up to the next assistant header), and a mask that is
    True on the replies of the ``trained`` assistant turns (one flag per message)."""
    if len(trained) != len(messages):
        raise ValueError("one trained flag per message")
    roles = [m.get("role") for m in messages]
    if not messages or roles[0] == "assistant" or roles[-1] != "assistant":
        raise ValueError("a conversation starts before its first assistant turn and ends with one")
    first = roles.index("assistant")
    ids = tok.render(messages[:first], tools=tools)
    mask = [False] * len(ids)
    stop = tok.end_of_turn_ids[:1]
    i = first
    while i < len(messages):
        reply = tok.encode(reply_text(tok, messages[i], tools)) + stop
        ids += reply
        mask += [bool(trained[i])] * len(reply)
        j = i + 1
        while j < len(messages) and roles[j] != "assistant":
            j += 1
        if j < len(messages):  # the observations, user turns, and the next assistant header
            more = tok.continuation(ids, messages[i + 1 : j], tools=tools)
            ids += more
            mask += [False] * len(more)
        i = j
    if not any(mask):
        raise ValueError("a conversation needs at least one trained assistant turn")
    return ids, mask
