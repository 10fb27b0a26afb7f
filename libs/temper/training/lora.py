"""LoRA adapters (PEFT) on a policy model.

:func:`apply_lora` wraps a causal LM in a ``PeftModel`` whose only trainable weights are
the adapters; the base weights stay frozen. With an adapter the KL reference policy is
the same model with the adapter switched off (:func:`reference_off`), so no second copy
of the base weights is held.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from temper.jobspec import LoraSpec


class LoraTargetError(ValueError):
    """``target_modules`` names no linear layer of the model."""


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear layer (what ``target_modules`` matches)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def apply_lora(model: torch.nn.Module, spec: LoraSpec, *, adapter_name: str = "default") -> torch.nn.Module:
    """``model`` with a fresh LoRA adapter on ``spec.target_modules`` (the base frozen)."""
    from peft import LoraConfig, get_peft_model

    names = set(linear_names(model))
    missing = [t for t in spec.target_modules if t.rsplit(".", 1)[-1] not in names]
    if missing:
        raise LoraTargetError(
            f"algorithm.lora.target_modules {missing} name no linear layer of the model; it has {sorted(names)}"
        )
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # a float scale works; peft annotates int
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with peft_quiet():
        return get_peft_model(model, config, adapter_name=adapter_name)  # type: ignore[arg-type]


@contextlib.contextmanager
def peft_quiet() -> Iterator[None]:
    """peft 0.21 reads ``is_gradient_checkpointing``, which transformers 5 deprecates
    with a FutureWarning; that is peft's business, not a fault of ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def reference_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the duration: adapters disabled, dropout untouched."""
    with model.disable_adapter():  # type: ignore[operator]
        yield


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, tensors)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"adapter checkpoint does not match the model's adapter: unexpected={unexpected[:5]}"
        )
