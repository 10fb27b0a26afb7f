"""Which backends can serve a job, and whether one is free for it now (torch-free).

A job is served by a backend of its pool (``policy.backend_pool``) that can load what it
trains (a LoRA adapter, or full weights) on the model it starts from: ``policy.init``,
else ``policy.model``. A backend serves the model names it was configured with (its
served name, its model directory, its preset); a backend that loads models (the CPU model
runner, in-process or over HTTP) also takes a model directory or object-store prefix. A
vLLM server's base is the model it was started with, and it loads either adapters or full
weights (``TEMPER_INFERENCE__VLLM_RELOAD_MODE``).

At most one job's full weights are on a backend; the LoRA jobs on one base model share a
backend. The dispatcher starts a job only when the running jobs and it can each have
theirs (:func:`wait_reason`); the gateway places the weights itself (its
``weights.py``), by the same rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings, VLLMReloadMode

LORA, FULL = "lora", "full"


@dataclass(frozen=True)
class BackendInfo:
    """What one backend can serve."""

    name: str
    pool: str
    kind: str
    models: frozenset[str]  # the model names its own weights answer to
    loads_models: bool  # it takes any model directory or object-store prefix too
    weights: frozenset[str]  # what it loads: "lora", "full"

    def serves(self, need: Need) -> bool:
        if need.pool != self.pool or (FULL if need.full else LORA) not in self.weights:
            return False
        return need.base in self.models or (self.loads_models and is_model_ref(need.base))


@dataclass(frozen=True)
class Need:
    """What a job needs served: its base model, its pool, full weights or an adapter."""

    job: str
    base: str
    pool: str = "default"
    full: bool = True


def is_model_ref(ref: str) -> bool:
    """A model directory or object-store prefix, as opposed to a served model's name."""
    return "/" in ref


def origin_names(spec: BackendSpec, model_name: str) -> frozenset[str]:
    """The names a backend's own weights answer to: its served model name, its model
    directory, and (a CPU runner without one) its preset."""
    names = {spec.model or model_name}
    if spec.model_dir:
        names.add(spec.model_dir)
    elif spec.kind is not BackendKind.vllm:
        names.add(spec.preset)
    return frozenset(names)


def backend_info(spec: BackendSpec, settings: InferenceSettings) -> BackendInfo:
    if spec.kind is BackendKind.vllm:
        weights = {LORA if settings.vllm_reload_mode is VLLMReloadMode.lora else FULL}
    else:
        weights = {LORA, FULL}
    return BackendInfo(
        name=spec.name,
        pool=spec.pool,
        kind=spec.kind.value,
        models=origin_names(spec, settings.model_name),
        loads_models=spec.kind is not BackendKind.vllm,
        weights=frozenset(weights),
    )


def deployment_backends(settings: InferenceSettings, *, embedded: bool) -> list[BackendSpec]:
    """The backends a gateway runs: the configured ones, else (embedded mode) one CPU runner
    in the gateway process, ``local-0``."""
    if settings.backends or not embedded:
        return list(settings.backends)
    return [BackendSpec(name="local-0", kind=BackendKind.local)]


def need_of(job: str, *, model: str, init: str | None, pool: str, lora: bool) -> Need:
    return Need(job=job, base=init or model, pool=pool, full=not lora)


# --- at the door ------------------------------------------------------------------------------
def serve_error(need: Need, backends: Sequence[BackendInfo]) -> str | None:
    """Why no backend of this deployment can ever serve ``need`` (with what it can), or None."""
    if any(b.serves(need) for b in backends):
        return None
    pools = sorted({b.pool for b in backends})
    if need.pool not in pools:
        return f"no backend pool {need.pool!r} here; pools: {', '.join(pools) or '(none)'}"
    what = FULL + " weights" if need.full else "LoRA adapters"
    lines = []
    for b in backends:
        if b.pool != need.pool:
            continue
        loads = " or any model directory" if b.loads_models else ""
        kinds = " and ".join(sorted(b.weights))
        lines.append(f"{b.name} ({b.kind}): {', '.join(sorted(b.models))}{loads}, {kinds}")
    return f"no backend of pool {need.pool!r} serves {need.base!r} with {what}; it serves: " + "; ".join(
        lines
    )


# --- at the start -----------------------------------------------------------------------------
def wait_reason(need: Need, running: Iterable[Need], backends: Sequence[BackendInfo]) -> str | None:
    """Why ``need`` cannot start now beside the ``running`` jobs, or None when it can: each
    running full-weight job keeps a backend of its own, the LoRA jobs on one base model
    share one, and the new job needs a backend too."""
    demands: list[tuple[str, Need]] = []  # (label, need) each to be matched to its own backend
    shared: dict[tuple[str, str], list[str]] = {}
    for r in running:
        if r.full:
            demands.append((f"job {r.job!r}'s full weights", r))
        else:
            shared.setdefault((r.pool, r.base), []).append(r.job)
    for (pool, base), jobs in sorted(shared.items()):
        if not need.full and (need.pool, need.base) == (pool, base):
            continue  # it joins them on their backend
        demands.append((f"LoRA jobs {', '.join(sorted(jobs))} on {base!r}", Need("", base, pool, full=False)))
    if _matches([d for _, d in demands] + [need], backends):
        return None
    names = [b.name for b in backends if b.pool == need.pool]
    held = [label for label, d in demands if d.pool == need.pool]
    return (
        f"waiting for a backend of pool {need.pool!r} ({', '.join(names) or 'none'}): "
        f"held by {'; '.join(held) or 'nothing'}"
    )


def _matches(needs: Sequence[Need], backends: Sequence[BackendInfo]) -> bool:
    """Can every need have a backend of its own (a bipartite matching, by augmenting paths)?"""
    owner: dict[int, int] = {}  # backend index -> need index

    def place(i: int, seen: set[int]) -> bool:
        for j, b in enumerate(backends):
            if j in seen or not b.serves(needs[i]):
                continue
            seen.add(j)
            if j not in owner or place(owner[j], seen):
                owner[j] = i
                return True
        return False

    return all(place(i, set()) for i in range(len(needs)))


# --- model directories --------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def missing_model_files(directory: Path) -> list[str]:
    """What a model directory lacks to be served and trained: ``config.json``, a tokenizer
    (``tokenizer.json``, or a SentencePiece/BPE vocabulary), the safetensors weights (one
    file, or an index and every shard it names). Empty: complete."""
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer.json")
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return [*missing, f"{WEIGHTS_INDEX} (unreadable)"]
        missing += [s for s in shards if not (directory / s).is_file()]
    elif not (directory / WEIGHTS_FILE).is_file():
        missing.append(WEIGHTS_FILE)
    return missing
