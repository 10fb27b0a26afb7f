"""Build a small model directory from scratch: a BPE tokenizer trained on a corpus with
``tokenizers``, a chat template, and a small random config of a real architecture.

No model hub is reachable here, so tests and the CPU examples make their models with
this; the result is an ordinary Hugging Face directory and goes through exactly the
code a downloaded checkpoint goes through (``load_model``).

Two templates: ``chatml`` (Qwen 2.5's shape: ``<|im_start|>role\\n...<|im_end|>\\n``,
tools listed in the system message, calls as ``<tool_call>{json}</tool_call>``, tool
results as ``<tool_response>`` in a user turn) and ``llama3`` (Llama 3.1's shape:
``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``, tools listed in the
first user message, calls as a JSON object, tool results in an ``ipython`` turn).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from temper.policy.tokenizer import ChatTokenizer, token_id

CHATML_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
{%- if call.function is defined %}{% set call = call.function %}{% endif %}
{% if loop.first and message.content %}
{% endif %}<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>{{ '\n' if not (loop.last or messages[loop.index0 + 1].role != 'tool') else '' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}
{%- if system or tools %}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ system }}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' and tools and loop.first %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content | trim }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0] %}{% if call.function is defined %}{% set call = call.function %}{% endif %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' or message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TEMPLATES: dict[str, dict[str, Any]] = {
    "chatml": {
        "template": CHATML_TEMPLATE,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "extra": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ["<|im_end|>", "<|endoftext|>"],
    },
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "specials": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|finetune_right_pad_id|>",
        ],
        "extra": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|finetune_right_pad_id|>",
        "stops": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
    },
}

# Small configs of real architectures: hidden 64, 2 layers (CPU tests run them in ms).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True, "head_dim": 16},
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False, "sliding_window": None},
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False},
}


def train_tokenizer(
    corpus: Iterable[str], *, template: str = "chatml", vocab_size: int = 512
) -> ChatTokenizer:
    """A byte-level BPE tokenizer trained on ``corpus``, with ``template``'s special tokens and chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {sorted(TEMPLATES)}")
    t = TEMPLATES[template]
    return train_chat_tokenizer(
        corpus,
        chat_template=t["template"],
        specials=t["specials"],
        extra=t["extra"],
        bos=t["bos"],
        eos=t["eos"],
        pad=t["pad"],
        stops=t["stops"],
        vocab_size=vocab_size,
    )


def train_chat_tokenizer(
    corpus: Iterable[str],
    *,
    chat_template: str,
    specials: Sequence[str],
    eos: str,
    stops: Sequence[str],
    bos: str | None = None,
    pad: str | None = None,
    unk: str | None = None,
    extra: Sequence[str] = (),
    vocab_size: int = 512,
) -> ChatTokenizer:
    """A byte-level BPE tokenizer trained on ``corpus`` with any chat template: ``specials``
    are special tokens (dropped when decoding without them; ``bos``, ``eos``, ``pad`` and
    ``unk`` name some of them), ``extra`` single tokens that decoding keeps (Qwen's
    ``<tool_call>``), ``stops`` the tokens generation stops on. What a model's tokenizer
    and template look like (the tests build Mistral's and Gemma's with it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits one by one, as Qwen2's and Llama 3's pre-tokenizers split numbers (Llama 3 in
    # threes): a number's tokens are its digits, which a small model can learn to copy
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    # tool-call tags are single tokens but not special: decoding keeps them, as Qwen's do
    tok.add_tokens([AddedToken(x, special=False, normalized=False) for x in extra])
    named = (bos, eos, pad, unk)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        additional_special_tokens=[s for s in specials if s not in named],
        model_max_length=4096,
    )
    hf.chat_template = chat_template
    return ChatTokenizer(hf, eos_token_ids=[token_id(hf, s) for s in stops])


def model_config(
    architecture: str,
    tok: ChatTokenizer,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 2048,
    head_dim: int | None = None,
    tie_word_embeddings: bool | None = None,
) -> Any:
    """``architecture``'s config at this size. ``head_dim`` is each head's width (by default
    ``hidden_size // heads``, or the architecture's own: qwen3's 16); vLLM's CPU attention
    needs 32 or more. ``tie_word_embeddings`` overrides the architecture's (qwen2 and qwen3
    tie the output layer to the embedding, as Qwen2.5-0.5B does)."""
    from transformers import AutoConfig

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")
    arch = dict(ARCHITECTURES[architecture])
    model_type = arch.pop("model_type")
    if head_dim is not None:
        if "head_dim" not in arch and head_dim * heads != hidden_size:
            # these architectures derive the width from hidden_size / heads
            raise ValueError(
                f"{architecture}: head_dim {head_dim} needs hidden_size = heads x head_dim "
                f"({heads} x {head_dim}), not {hidden_size}"
            )
        arch["head_dim"] = head_dim
    if tie_word_embeddings is not None:
        arch["tie_word_embeddings"] = tie_word_embeddings
    return AutoConfig.for_model(
        model_type,
        vocab_size=tok.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.stop_ids[0],
        pad_token_id=tok.pad_id,
        **arch,
    )


def build_model_dir(
    directory: str | Path,
    architecture: str,
    tok: ChatTokenizer,
    *,
    seed: int = 0,
    max_shard_size: str | int = "5GB",
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> Path:
    """A random ``architecture`` model sized to ``tok``, saved with it as a model directory."""
    from transformers import AutoModelForCausalLM

    from temper.policy.model import save_checkpoint

    cfg = model_config(architecture, tok, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.to(dtype)
    return save_checkpoint(model, directory, tokenizer=tok, max_shard_size=max_shard_size)
