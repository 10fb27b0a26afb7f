"""Reward models: a sequence classifier with one output (``AutoModelForSequenceClassification``,
``num_labels=1``) that gives a whole conversation a score, trained on (chosen, rejected)
pairs with the Bradley-Terry loss.

With ``r`` the score of a conversation, each pair's loss is ``-log sigmoid(r_chosen -
r_rejected)``, the negative log-likelihood of "chosen is preferred" when preferences
follow ``P(a > b) = sigmoid(r_a - r_b)``; a step averages it over its pairs. A
conversation is scored at its last token (transformers' pooling: the rightmost token that
is not padding), after the chat template of the model's own tokenizer renders it whole
(:func:`encode`): the same ids when it is trained (the trainer) and when it scores an
episode (the ``reward_model`` reward component).

A reward-model job starts from a causal LM (``policy.init``, ``policy.model`` or the
trainer's preset): :func:`from_causal_lm` keeps its body and puts a score head on it,
initialised to zero, so every conversation starts at score 0 (loss ``log 2``) whatever
the random state, and a restarted trainer rebuilds the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from temper.policy import ChatTokenizer, pad_batch


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Each pair's loss, ``-log sigmoid(r_chosen - r_rejected)``."""
    return -F.logsigmoid(chosen - rejected)


def encode(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """A conversation as the reward model reads it: the chat template's rendering of all of
    it (no generation prompt after it); past ``max_tokens`` the first tokens are dropped, so
    the end, where the model is read, stays."""
    ids = tok.render(messages, tools=tools, add_generation_prompt=False)
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[len(ids) - max_tokens :]
    return ids


def sequence_scores(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> torch.Tensor:
    """The model's score of each id sequence (float32, one per sequence), in one padded batch."""
    ids, attention = pad_batch([list(s) for s in sequences], pad_id)
    out = model(input_ids=ids.to(device), attention_mask=attention.to(device))
    logits = out.logits
    if logits.ndim != 2 or logits.shape[1] != 1:
        raise ValueError(f"a reward model has one output per sequence; this one gives {tuple(logits.shape)}")
    return logits[:, 0].float()


def _classifier(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    config.problem_type = "regression"
    return AutoModelForSequenceClassification.from_config(config)


def from_causal_lm(causal: torch.nn.Module, *, pad_id: int | None = None) -> torch.nn.Module:
    """A reward model with ``causal``'s body (its weights copied) and a zero score head."""
    import copy

    config: Any = copy.deepcopy(getattr(causal, "config"))  # noqa: B009 - nn.Module types attributes as tensors
    if pad_id is not None:
        config.pad_token_id = pad_id
    if getattr(config, "pad_token_id", None) is None:
        raise ValueError(
            "a reward model needs the config's pad_token_id (to find each sequence's last token)"
        )
    model = _classifier(config)
    prefix = str(model.base_model_prefix)
    body: Any = getattr(causal, str(getattr(causal, "base_model_prefix", prefix)))
    missing, unexpected = getattr(model, prefix).load_state_dict(body.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"the causal LM's body does not fit a {type(model).__name__}: missing={missing} unexpected={unexpected}"
        )
    score = getattr(model, "score", None)
    if not isinstance(score, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear score head")
    with torch.no_grad():
        score.weight.zero_()
        if score.bias is not None:
            score.bias.zero_()
    return model.float().eval()


def is_reward_model(directory: str | Path) -> bool:
    """Whether the model directory holds a sequence classifier with one output."""
    import json

    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    return any(str(a).endswith("ForSequenceClassification") for a in archs) and labels == 1


def load(directory: str | Path) -> tuple[torch.nn.Module, ChatTokenizer]:
    """A reward model directory (config, weights, tokenizer with its chat template)."""
    from transformers import AutoModelForSequenceClassification

    if not is_reward_model(directory):
        raise ValueError(
            f"{directory} is not a reward model: its config.json names no *ForSequenceClassification "
            "architecture with num_labels 1"
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        str(directory), local_files_only=True, dtype=torch.float32
    )
    return model.eval(), ChatTokenizer.load(directory)
