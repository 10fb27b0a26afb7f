"""The policy model shared by the CPU inference engine and the trainer.

- tokenizer: :class:`ByteTokenizer` (``encode``/``decode``), :func:`encode_chat`, :func:`extend_chat`
- model: :func:`create_model`, :func:`load_model`, :func:`save_checkpoint`, :func:`load_weights`
- logprobs: :func:`token_logprobs` (the same function for generation checks and training)
"""

from temper.policy.model import (
    PRESETS,
    create_model,
    forward,
    load_model,
    load_weights,
    model_config,
    pad_batch,
    position_ids_from_mask,
    read_metadata,
    save_checkpoint,
    save_weights,
    token_logprobs,
)
from temper.policy.tokenizer import (
    ByteTokenizer,
    assistant_stop_ids,
    default_tokenizer,
    encode_chat,
    encode_message,
    extend_chat,
    generation_prompt,
)

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "assistant_stop_ids",
    "create_model",
    "default_tokenizer",
    "encode_chat",
    "encode_message",
    "extend_chat",
    "forward",
    "generation_prompt",
    "load_model",
    "load_weights",
    "model_config",
    "pad_batch",
    "position_ids_from_mask",
    "read_metadata",
    "save_checkpoint",
    "save_weights",
    "token_logprobs",
]
