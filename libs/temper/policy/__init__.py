"""The policy model shared by the CPU inference engine and the trainer.

- tokenizer: :class:`ChatTokenizer` (a fast tokenizer with its chat template and stop ids),
  :func:`byte_tokenizer` (the CPU presets'), :func:`encode_chat`, :func:`extend_chat`
- model: :func:`load_model` (any Hugging Face causal LM directory), :func:`create_model`
  (CPU presets), :func:`save_checkpoint` (in the dtype the model was stored in,
  :func:`stored_dtype`), :func:`load_weights`
- logprobs: :func:`token_logprobs` (the same function for generation checks and training)

Names are imported lazily, so ``temper.settings.inference`` (read by ``temper.settings``) does
not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# ruff: noqa: F401 - the imports below only give mypy the types of the lazy names
if TYPE_CHECKING:  # the same names, typed for mypy (at run time they load on first use)
    from temper.policy.model import (
        PRESETS,
        create_model,
        forward,
        is_model_dir,
        load_causal_lm,
        load_model,
        load_weights,
        model_config,
        pad_batch,
        position_ids_from_mask,
        read_metadata,
        save_checkpoint,
        save_weights,
        stored_dtype,
        token_logprobs,
    )
    from temper.policy.tokenizer import (
        ChatTokenizer,
        TemplateError,
        assistant_stop_ids,
        byte_tokenizer,
        default_tokenizer,
        encode_chat,
        extend_chat,
    )

_MODEL = (
    "PRESETS",
    "create_model",
    "forward",
    "is_model_dir",
    "load_causal_lm",
    "load_model",
    "load_weights",
    "model_config",
    "pad_batch",
    "position_ids_from_mask",
    "read_metadata",
    "save_checkpoint",
    "save_weights",
    "stored_dtype",
    "token_logprobs",
)
_TOKENIZER = (
    "ChatTokenizer",
    "TemplateError",
    "assistant_stop_ids",
    "byte_tokenizer",
    "default_tokenizer",
    "encode_chat",
    "extend_chat",
)
__all__ = [*_MODEL, *_TOKENIZER]


def __getattr__(name: str) -> Any:
    if name in _MODEL:
        return getattr(importlib.import_module("temper.policy.model"), name)
    if name in _TOKENIZER:
        return getattr(importlib.import_module("temper.policy.tokenizer"), name)
    raise AttributeError(f"module 'temper.policy' has no attribute {name!r}")
