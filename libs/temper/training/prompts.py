"""A group's shared prompt, run through the model once per micro-batch instead of once per sample.

The samples of a GRPO group start with the same prompt (every token before the model's
first one), and on the example job the prompt is two thirds of every sample's tokens. A
step that shares it runs the decoder on each distinct prompt once, keeps its keys and
values, and runs each sample's own tokens (the model's and any later observations) on
top of them: the logprobs and the gradient are the plain forward's, up to float rounding
(``tests/libs/training/test_prompts.py`` compares both), for about 40 % less of the step's
CPU on the example (docs/training.md, Learning speed against TRL).

:func:`prompt_micro_batches` packs whole prompt groups under the padded-token budget (a
group too large for it is cut into parts that each run the prompt once), and
:func:`shared_prompt_logprobs` is :func:`temper.training.learner.completion_logprobs` for
such a micro-batch, in the same layout as :func:`temper.training.batch.collate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from temper.policy.model import cache_arg, position_ids_from_mask
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


def prompt_micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Whole prompt groups packed into micro-batches whose padded tokens (each part's
    prompt once, each sample's own tokens) stay within ``token_budget``; a group that alone
    exceeds it is cut into parts (each runs its prompt once), and a single sample over it
    goes alone."""
    parts: list[tuple[list[Sample], int, int]] = []  # samples, prompt length, longest own part
    for group in prompt_groups(samples):
        width = prompt_length(group[0])
        current: list[Sample] = []
        rest = 0
        for s in sorted(group, key=lambda s: len(s.ids), reverse=True):
            own = len(s.ids) - width
            if current and width + (len(current) + 1) * max(rest, own) > token_budget:
                parts.append((current, width, rest))
                current, rest = [], 0
            current.append(s)
            rest = max(rest, own)
        parts.append((current, width, rest))
    parts.sort(key=lambda p: p[1] + p[2], reverse=True)
    out: list[list[Sample]] = []
    batch: list[Sample] = []
    prompts = width = rest = 0
    for part, w, r in parts:
        if batch and (prompts + 1) * max(width, w) + (len(batch) + len(part)) * max(rest, r) > token_budget:
            out.append(batch)
            batch, prompts, width, rest = [], 0, 0, 0
        batch += part
        prompts += 1
        width, rest = max(width, w), max(rest, r)
    if batch:
        out.append(batch)
    return out


def can_share(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a separate decoder (which takes a key/value cache) and output layer."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return decoder is not None and head is not None


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
    lengths = [prompt_length(s) for s in samples]
    keys: dict[tuple[int, ...], int] = {}
    of_row = [keys.setdefault(tuple(s.ids[:n]), len(keys)) for s, n in zip(samples, lengths, strict=True)]
    prompts = list(keys)
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
    name = cache_arg(decoder)  # the cache's keyword, and its output's name
    kv = getattr(first, name)
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
        use_cache=True,
        **{name: kv},
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
        from temper.training.learner import policy_entropy  # here: the learner imports this module

        entropy.append(
            torch.zeros_like(out).index_put((index[0], index[1] + 1), policy_entropy(logp, entropy_grad))
        )
    return out.index_put((index[0], index[1] + 1), picked)
