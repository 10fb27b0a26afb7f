"""LoRA adapters (PEFT) on a policy model.

:func:`apply_lora` wraps a causal LM in a ``PeftModel`` whose only trainable weights are
the adapters; the base weights stay frozen. With an adapter the KL reference policy is
the same model with the adapter switched off (:func:`reference_off`), so no second copy
of the base weights is held.

:class:`SharedBase` holds one frozen base model for several jobs: each job adds its own
named adapter (PEFT's multi-adapter model) and activates it for everything it does with
the model, one job at a time.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from temper.jobspec import DEFAULT_LORA_TARGETS, LoraSpec


class LoraTargetError(ValueError):
    """``target_modules`` names no linear layer of the model."""


# The fused layer that holds a separate projection, in models that fuse them (Phi-3).
FUSED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear layer (what ``target_modules`` matches)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def resolve_targets(spec: LoraSpec, names: list[str]) -> list[str]:
    """The modules that get an adapter on a model whose linear layers are ``names``: the
    spec's ``target_modules``, each of which must name one (a separate projection that the
    model fuses is refused with the fused layer's name), or by default every one of
    :data:`~temper.jobspec.DEFAULT_LORA_TARGETS` the model has (Llama's q/k/v/o and MLP
    projections, Phi-3's ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``)."""
    have = set(names)
    if spec.target_modules is None:
        targets = [t for t in DEFAULT_LORA_TARGETS if t in have]
        if not targets:
            raise LoraTargetError(
                f"the model has none of the default LoRA target modules {list(DEFAULT_LORA_TARGETS)}; "
                f"name its layers in algorithm.lora.target_modules; it has {sorted(names)}"
            )
        return targets
    missing = [t for t in spec.target_modules if t.rsplit(".", 1)[-1] not in have]
    if missing:
        fused = sorted({FUSED_INTO[m] for m in missing if FUSED_INTO.get(m) in have})
        hint = f" (it fuses them: name {', '.join(fused)})" if fused else ""
        raise LoraTargetError(
            f"algorithm.lora.target_modules {missing} name no linear layer of the model{hint}; "
            f"it has {sorted(names)}"
        )
    return list(spec.target_modules)


def check_targets(spec: LoraSpec, names: list[str]) -> None:
    """Refuse ``target_modules`` that name none of ``names`` (the model's linear layers)."""
    resolve_targets(spec, names)


def lora_config(spec: LoraSpec, names: list[str]) -> Any:
    """PEFT's config of ``spec`` on a model whose linear layers are ``names``."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # a float scale works; peft annotates int
        lora_dropout=spec.dropout,
        target_modules=resolve_targets(spec, names),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, spec: LoraSpec, *, adapter_name: str = "default") -> torch.nn.Module:
    """``model`` with a fresh LoRA adapter on ``spec``'s target modules (the base frozen)."""
    from peft import get_peft_model

    config = lora_config(spec, linear_names(model))
    with peft_quiet():
        return get_peft_model(model, config, adapter_name=adapter_name)  # type: ignore[arg-type]


class SharedBase:
    """One base model in memory, frozen, under several jobs' LoRA adapters.

    Each job's :meth:`add` gives it an adapter of its own (its spec: rank, alpha, targets);
    :meth:`active` makes that adapter the only one in the forward pass and the only
    trainable weights, and holds ``lock`` meanwhile, so jobs stepping in turn from
    different threads never see each other's adapter. With every adapter off
    (:func:`reference_off`) the model is the base: each job's KL reference.
    """

    def __init__(self, base: torch.nn.Module, *, key: str = "") -> None:
        self.key = key
        self.linear = linear_names(base)  # read before PEFT wraps the layers
        self.model: torch.nn.Module = base  # a PeftModel once the first adapter is added
        self.adapters: list[str] = []
        self.lock = threading.RLock()
        self._added = 0

    def add(self, spec: LoraSpec) -> str:
        """A fresh adapter for one job; returns its name (active on return)."""
        with self.lock:
            check_targets(spec, self.linear)
            name = f"job{self._added}"
            if not self.adapters:
                self.model = apply_lora(self.model, spec, adapter_name=name)
            else:
                with peft_quiet():
                    self.model.add_adapter(name, lora_config(spec, self.linear))  # type: ignore[operator]
            self._added += 1
            self.adapters.append(name)
            self.model.set_adapter(name)  # type: ignore[operator]
            return name

    def remove(self, name: str) -> None:
        """Drop an adapter (a job that failed to start); the last one stays, it is the
        model's only handle on the base."""
        with self.lock:
            if name in self.adapters and len(self.adapters) > 1:
                self.model.delete_adapter(name)  # type: ignore[operator]
                self.adapters.remove(name)

    @contextlib.contextmanager
    def active(self, name: str) -> Iterator[torch.nn.Module]:
        """The model with adapter ``name`` on (and trainable), the others off, for the duration."""
        with self.lock:
            self.model.set_adapter(name)  # type: ignore[operator]
            yield self.model

    def base_parameters(self) -> list[torch.nn.Parameter]:
        """The base model's weights (every parameter but the adapters')."""
        return [p for n, p in self.model.named_parameters() if "lora_" not in n]


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


def adapter_state(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights on the CPU, under PEFT's key names (without the adapter's name)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def load_adapter_state(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], adapter_name: str = "default"
) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, tensors, adapter_name=adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(
            f"adapter checkpoint does not match the model's adapter: unexpected={unexpected[:5]}"
        )


def save_adapter(model: torch.nn.Module, directory: str | Path, adapter_name: str = "default") -> None:
    """One adapter as a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) at ``directory`` itself, whatever its name."""
    model.save_pretrained(str(directory), selected_adapters=[adapter_name])  # type: ignore[operator]
    if adapter_name != "default":  # PEFT writes a named adapter into a subdirectory
        sub = Path(directory) / adapter_name
        for f in sub.iterdir():
            shutil.move(str(f), Path(directory) / f.name)
        sub.rmdir()


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> None:
    """Write ``out_dir``: a Hugging Face model directory with the adapter of ``adapter_dir``
    folded into the weights of the model in ``base_dir``, in the base's own dtype, with the
    base's tokenizer and chat template (what ``temper export-model --merge`` writes)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype="auto")
    with peft_quiet():
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out_dir))
