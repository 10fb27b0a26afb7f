"""The policy model shared by the CPU inference engine and the trainer.

- tokenizer: :class:`ByteTokenizer` (``encode``/``decode``), :func:`encode_chat`, :func:`extend_chat`
- model: :func:`create_model`, :func:`load_model`, :func:`save_checkpoint`, :func:`load_weights`
- logprobs: :func:`token_logprobs` (the same function for generation checks and training)

Names are imported lazily, so ``temper.policy.config`` (read by ``temper.settings``) does
not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODEL = (
    "PRESETS",
    "create_model",
    "forward",
    "load_model",
    "load_weights",
    "model_config",
    "pad_batch",
    "position_ids_from_mask",
    "read_metadata",
    "save_checkpoint",
    "save_weights",
    "token_logprobs",
)
_TOKENIZER = (
    "ByteTokenizer",
    "assistant_stop_ids",
    "default_tokenizer",
    "encode_chat",
    "encode_message",
    "extend_chat",
    "generation_prompt",
)
__all__ = [*_MODEL, *_TOKENIZER]


def __getattr__(name: str) -> Any:
    if name in _MODEL:
        return getattr(importlib.import_module("temper.policy.model"), name)
    if name in _TOKENIZER:
        return getattr(importlib.import_module("temper.policy.tokenizer"), name)
    raise AttributeError(f"module 'temper.policy' has no attribute {name!r}")
