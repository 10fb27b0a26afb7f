"""The policy model: any causal LM ``transformers`` loads from a Hugging Face model directory.

A model directory holds ``config.json``, safetensors weights (one file, or shards with
``model.safetensors.index.json``), ``generation_config.json`` and the tokenizer with
its chat template. :func:`load_model` reads one with ``AutoModelForCausalLM`` and
:class:`~temper.policy.tokenizer.ChatTokenizer`; nothing is fetched from a model hub.
The CPU presets (:func:`create_model`) are small ``Qwen2`` configs with seeded random
weights and the byte tokenizer, saved in the same layout by :func:`save_checkpoint`.
:func:`token_logprobs` is the one function that turns a model and token ids into
per-token logprobs; the CPU engine checks its sampled logprobs against it and the
trainer uses it for the loss.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from temper.policy.tokenizer import ChatTokenizer, default_tokenizer

STORED_DTYPE = "temper_stored_dtype"  # set on a loaded model: the dtype its directory stores
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
META_FILE = "temper.json"


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048


PRESETS: dict[str, Preset] = {
    # ~0.5M parameters: trains on two CPU cores in minutes, generates at ~1 ms/token.
    "tiny": Preset(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
    ),
    # ~3M parameters: still CPU-friendly, more capacity for the example job.
    "small": Preset(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
    ),
}


def model_config(preset: str = "tiny", *, tokenizer: ChatTokenizer | None = None) -> Qwen2Config:
    """The ``Qwen2Config`` of a preset, sized to ``tokenizer`` (default: the byte tokenizer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    tok = tokenizer or default_tokenizer()
    p = PRESETS[preset]
    return Qwen2Config(
        vocab_size=tok.vocab_size,  # exact: no unused ids a sampler could draw
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.stop_ids[0] if tok.stop_ids else None,
        pad_token_id=tok.pad_id,
        torch_dtype="float32",  # type: ignore[call-arg]  # a PretrainedConfig kwarg the stubs do not list
    )


def create_model(
    preset: str = "tiny", *, seed: int = 0, tokenizer: ChatTokenizer | None = None
) -> Qwen2ForCausalLM:
    """A fresh model of ``preset`` with random weights drawn from ``seed`` (same seed, same weights)."""
    cfg = model_config(preset, tokenizer=tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.eval()


def stored_dtype(source: torch.nn.Module | str | Path) -> torch.dtype:
    """The dtype a model's weights are stored in: a model directory's (its config's
    ``dtype``, or the older ``torch_dtype``; float32 when it names none), or, for a model,
    the one its directory had when it was loaded (:func:`load_model` keeps it on the model,
    which computes in float32), else its parameters'."""
    if isinstance(source, torch.nn.Module):
        kept = getattr(source, STORED_DTYPE, None)
        if isinstance(kept, torch.dtype):
            return kept
        return next(source.parameters()).dtype
    config = json.loads((Path(source) / CONFIG_FILE).read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{source}: {CONFIG_FILE} names dtype {name!r}, not a floating-point torch dtype")
    return dtype


def save_checkpoint(
    model: torch.nn.Module,
    directory: str | Path,
    *,
    tokenizer: ChatTokenizer | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_size: str | int = "5GB",
    state_dict: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a Hugging Face model directory: config, safetensors weights (sharded with an
    index above ``max_shard_size``), generation config (its eos ids are the tokenizer's
    stop ids) and the tokenizer with its chat template (+ ``temper.json``). ``state_dict``:
    the weights to write instead of the model's own (a sharded model's, gathered).
    ``dtype``: the dtype the weights are stored in, by default the model's
    :func:`stored_dtype` (a bf16 directory loaded to train in float32 is written back in
    bf16), and the config says so."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or default_tokenizer()
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = list(tok.stop_ids)
        gen.pad_token_id = tok.pad_id
    dtype = dtype or stored_dtype(model)
    weights = state_dict if state_dict is not None else model.state_dict()
    if any(t.is_floating_point() and t.dtype != dtype for t in weights.values()):
        state_dict = {k: t.to(dtype) if t.is_floating_point() else t for k, t in weights.items()}
    model.save_pretrained(str(d), max_shard_size=max_shard_size, state_dict=state_dict)  # type: ignore[operator]
    config_path = d / CONFIG_FILE
    config = json.loads(config_path.read_text())
    if config.get("dtype") != str(dtype).removeprefix("torch."):
        # save_pretrained writes the parameters' dtype, not the one the weights were written in
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save(d)
    if metadata:
        (d / META_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
    return d


def save_weights(model: torch.nn.Module, path: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
    """The model's weights alone, as one safetensors file (tied embeddings stored once)."""
    state = model.state_dict()
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    tensors = {
        k: v.detach().to("cpu").contiguous().clone()
        for k, v in state.items()
        if not (tied and k == "lm_head.weight")
    }
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    save_file(tensors, str(path), metadata=meta or None)
    return Path(path)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory (every shard named by its index), or ``path`` itself."""
    p = Path(path)
    if not p.is_dir():
        return [p]
    index = p / WEIGHTS_INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [p / s for s in shards]
    return [p / WEIGHTS_FILE]


def load_weights(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load safetensors weights (a file, or a model directory, sharded or not) into an
    existing model of the same architecture (in place)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        tensors.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing={missing} unexpected={unexpected}")
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]  # nn.Module's __getattr__ types it as a Tensor
    return model


def is_model_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def load_model(
    directory: str | Path, *, dtype: torch.dtype | str = torch.float32
) -> tuple[torch.nn.Module, ChatTokenizer]:
    """Model (``AutoModelForCausalLM``) and tokenizer from a local model directory.

    ``dtype="auto"`` keeps the config's dtype; the default float32 is what CPU engines
    and the trainer's master weights use."""
    d = Path(directory)
    if not is_model_dir(d):
        raise FileNotFoundError(f"{d} is not a model directory (no {CONFIG_FILE})")
    return load_causal_lm(d, dtype=dtype), ChatTokenizer.load(d)


def read_metadata(directory: str | Path) -> dict[str, Any]:
    p = Path(directory) / META_FILE
    return json.loads(p.read_text()) if p.exists() else {}


# --- forward passes ----------------------------------------------------------------------

_FORWARD_CACHE_ARG: dict[type, str] = {}


def cache_arg(model: torch.nn.Module) -> str:
    """``cache`` in recent transformers, ``past_key_values`` before."""
    cls = type(model)
    if cls not in _FORWARD_CACHE_ARG:
        # a PEFT wrapper takes **kwargs and passes them on: ask the model it wraps
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
        params = inspect.signature(inner.forward).parameters
        _FORWARD_CACHE_ARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _FORWARD_CACHE_ARG[cls]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore padding: the first real token of each row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool = False,
    adapter_names: list[str] | None = None,
) -> tuple[torch.Tensor, Any]:
    """Logits ``[B, T, V]`` (float32) and the updated KV cache. ``adapter_names`` (a PEFT
    model only): the LoRA adapter of each row, ``"__base__"`` for none."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "use_cache": use_cache,
    }
    if cache is not None:
        kwargs[cache_arg(model)] = cache
    if adapter_names is not None:
        kwargs["adapter_names"] = adapter_names
    out = model(**kwargs)
    name = cache_arg(model)
    new_cache = getattr(out, name, None)
    return out.logits.float(), new_cache


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    entropy: list[torch.Tensor] | None = None,
    entropy_grad: bool = True,
) -> torch.Tensor:
    """Per-token logprobs ``[B, T]``: ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``.

    The first real token of each row has no context and is 0; so are padded positions (``attention_mask == 0``)
    and, when ``completion_mask`` is given, every position where it is 0 (prompt and
    observation tokens). Works with left or right padding. Gradients flow when called
    outside ``torch.no_grad()``. ``temperature`` divides the logits first (1.0 = the raw
    model distribution, which is what the CPU engine reports). With ``entropy`` (a list), the
    policy's entropy at each position is appended to it, ``[B, T]`` and masked like the
    result (differentiable only with ``entropy_grad``).
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    logits, _ = forward(model, input_ids, attention_mask)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    am = attention_mask.to(out.dtype)
    # a token is scored only if it and the token before it are real (the first real token is not)
    mask = torch.cat([torch.zeros_like(am[:, :1]), am[:, 1:] * am[:, :-1]], dim=1)
    if completion_mask is not None:
        mask = mask * completion_mask.to(out.dtype)
    if entropy is not None:
        if entropy_grad and torch.is_grad_enabled():
            h = -(logp.exp() * logp).sum(-1)
        else:  # measured only: in place, one extra copy of logp
            with torch.no_grad():
                h = -logp.exp().mul_(logp).sum(-1)
        entropy.append(torch.cat([torch.zeros_like(h[:, :1]), h], dim=1) * mask)
    return out * mask


def pad_batch(
    sequences: list[list[int]], pad_id: int, *, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad id lists into ``(input_ids, attention_mask)`` (right padding unless ``left``)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if left:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        else:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids, mask


def load_causal_lm(directory: str | Path, *, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    """The model alone (no tokenizer needed), e.g. for the trainer. It remembers the dtype
    its directory stores (:func:`stored_dtype`), which :func:`save_checkpoint` writes back."""
    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=dtype).eval()
    setattr(model, STORED_DTYPE, stored_dtype(directory))
    return model
