"""A group's shared prompt, run through the model once per micro-batch instead of once per sample.

The samples of a GRPO group start with the same prompt (every token before the model's
first one), and on the example job the prompt is two thirds of every sample's tokens. A
step that shares it runs the decoder on each distinct prompt once, keeps its keys and
values, and runs each sample's own tokens (the model's and any later observations) on
top of them: the logprobs and the gradient are the plain forward's, up to float rounding
(``tests/libs/training/test_prompts.py`` compares both), for about half the step's CPU on
the example (docs/training.md, Learning speed against TRL).

:func:`prompt_micro_batches` packs whole prompt groups under the padded-token budget (a
group too large for it is cut into parts that each run the prompt once), and
:func:`shared_prompt_logprobs` is :func:`temper.training.learner.completion_logprobs` for
such a micro-batch, in the same layout as :func:`temper.training.batch.collate`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from temper.policy.model import position_ids_from_mask
from temper.training.batch import Batch, Sample


def prompt_length(s: Sample) -> int:
    """Tokens before the sample's first model token (at least 1: token 0 is never scored)."""
    first = next((i for i, m in enumerate(s.mask) if m), len(s.ids))
    return max(1, first)


def prompt_groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    """The samples grouped by their prompt's token ids, in first-seen order."""
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        groups.setdefault(tuple(s.ids[: prompt_length(s)]), []).append(s)
    return list(groups.values())


def _cost(parts: Sequence[Sequence[Sample]]) -> int:
    """Padded tokens of a micro-batch of prompt groups: each prompt once, each sample's rest."""
    prompt = max(prompt_length(p[0]) for p in parts)
    rest = max(len(s.ids) - prompt_length(s) for p in parts for s in p)
    return len(parts) * prompt + sum(len(p) for p in parts) * rest


def prompt_micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Whole prompt groups packed into micro-batches whose padded tokens (:func:`_cost`)
    stay within ``token_budget``; a group that alone exceeds it is cut into parts (each
    runs its prompt once), and a single sample over it goes alone."""
    parts: list[list[Sample]] = []
    for group in prompt_groups(samples):
        group = sorted(group, key=lambda s: len(s.ids), reverse=True)
        current: list[Sample] = []
        for s in group:
            if current and _cost([[*current, s]]) > token_budget:
                parts.append(current)
                current = []
            current.append(s)
        parts.append(current)
    parts.sort(key=lambda p: max(len(s.ids) for s in p), reverse=True)
    out: list[list[Sample]] = []
    batch: list[list[Sample]] = []
    for part in parts:
        if batch and _cost([*batch, part]) > token_budget:
            out.append([s for p in batch for s in p])
            batch = []
        batch.append(part)
    if batch:
        out.append([s for p in batch for s in p])
    return out


_TAKES_CACHE: dict[type, bool] = {}


def _takes_cache(decoder: torch.nn.Module) -> bool:
    cls = type(decoder)
    if cls not in _TAKES_CACHE:
        _TAKES_CACHE[cls] = "cache" in inspect.signature(cls.forward).parameters
    return _TAKES_CACHE[cls]


def can_share(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a decoder that takes a key/value cache and a separate output layer."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return decoder is not None and head is not None and _takes_cache(decoder)


def shared_prompt_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    b: Batch,
    pad_id: int,
    entropy: list[torch.Tensor] | None = None,
    entropy_grad: bool = True,
) -> torch.Tensor:
    """The logprob of every scored token of ``b`` (``collate(samples)``), 0 elsewhere, as
    ``completion_logprobs`` gives it, with each distinct prompt run once. ``entropy`` as
    there. The caller checks :func:`can_share` first."""
    decoder: Any = getattr(model, "get_decoder")()  # noqa: B009 - a Module attribute mypy reads as a Tensor
    head: Any = getattr(model, "get_output_embeddings")()  # noqa: B009
    device = b.input_ids.device
    keys: dict[tuple[int, ...], int] = {}
    of_row: list[int] = []
    for s in samples:
        of_row.append(keys.setdefault(tuple(s.ids[: prompt_length(s)]), len(keys)))
    prompts = list(keys)
    lengths = [prompt_length(s) for s in samples]
    width = max(len(p) for p in prompts)
    rest = max(1, max(len(s.ids) - n for s, n in zip(samples, lengths, strict=True)))
    # the prompts, right-padded: run once, their keys and values then chosen per row
    p_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    p_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        p_ids[j, : len(p)] = torch.tensor(p, dtype=torch.long)
        p_mask[j, : len(p)] = 1
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    first = decoder(
        input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids_from_mask(p_mask), use_cache=True
    )
    rows = torch.tensor(of_row, dtype=torch.long, device=device)
    kv = first.cache
    kv.batch_select_indices(rows)
    # each row's own tokens after its prompt, at the positions they have in the sample
    s_ids = torch.full((len(samples), rest), pad_id, dtype=torch.long)
    s_mask = torch.zeros((len(samples), rest), dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        own = s.ids[n:]
        s_ids[i, : len(own)] = torch.tensor(own, dtype=torch.long)
        s_mask[i, : len(own)] = 1
    s_ids, s_mask = s_ids.to(device), s_mask.to(device)
    starts = torch.tensor(lengths, dtype=torch.long, device=device)
    positions = starts[:, None] + torch.arange(rest, device=device)[None, :]
    second = decoder(
        input_ids=s_ids,
        attention_mask=torch.cat([p_mask[rows], s_mask], dim=1),
        position_ids=positions,
        cache=kv,
        use_cache=True,
    ).last_hidden_state
    hidden = torch.cat([first.last_hidden_state.flatten(0, 1), second.flatten(0, 1)])
    am = b.attention_mask.bool()
    # token t is scored from the hidden state at t-1: the prompt's last, or the row's own
    scored = b.completion_mask[:, 1:].bool() & am[:, 1:] & am[:, :-1]
    index = scored.nonzero(as_tuple=True)
    at = index[1]  # t - 1
    start = starts[index[0]]
    source = torch.where(
        at < start,
        rows[index[0]] * width + at,
        len(prompts) * width + index[0] * rest + (at - start),
    )
    logp = torch.log_softmax(head(hidden[source]).float(), dim=-1)
    picked = logp.gather(-1, b.input_ids[:, 1:][scored].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(b.input_ids.shape, dtype=picked.dtype, device=device)
    if entropy is not None:
        from temper.training.learner import policy_entropy

        entropy.append(
            torch.zeros_like(out).index_put((index[0], index[1] + 1), policy_entropy(logp, entropy_grad))
        )
    return out.index_put((index[0], index[1] + 1), picked)
