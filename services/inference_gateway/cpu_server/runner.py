"""The CPU model runner: a model, what it serves, and token-in/token-out generation with
a KV cache (the decoding itself, rows joining and leaving a running batch, and sampling
with each request's own generator: :mod:`.decoding`).

Many jobs share one base model: each job's policy is a LoRA adapter (PEFT) named
``<job>-v<version>``, chosen per request by ``job_id``. Requests of different jobs run
in the same batch: PEFT's ``adapter_names`` applies each row's own adapter inside every
LoRA layer (rows without an adapter get ``__base__``, the base model), so one forward
step serves every adapter at once. Every output carries the version of the adapter (or
base weights) that produced it. A full-weights version replaces the base weights.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from services.inference_gateway.cpu_server.decoding import (
    Decoding,
    GenOutput,
    GenRequest,
    Row,
    SamplingParams,
    Stopped,
)

__all__ = [
    "GenOutput",
    "GenRequest",
    "Holding",
    "ModelRunner",
    "NotServed",
    "SamplingParams",
    "Stopped",
    "build_runner",
]
from temper.policy import ChatTokenizer, is_model_dir, load_model, load_weights
from temper.registry import CorruptVersion, verify_directory

log = logging.getLogger(__name__)


# The config fields that make two models of one family the same architecture (a full
# version with these is loaded into the model in place; otherwise the model is replaced).
_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)

Origin = Callable[[], tuple[torch.nn.Module, ChatTokenizer]]
_PEFT_LOCK = threading.Lock()


class NotServed(Exception):
    """The runner cannot do this for that job now: another job's full weights are loaded,
    or jobs' adapters are on the base that would have to change."""


@dataclass
class Holding:
    """What a runner serves, as it reports it to the gateway (``GET /health`` of the CPU
    model server): its base weights (``base``: the model directory, object key or preset
    they came from; ``at_origin``: the weights it started with), the job whose full
    weights replaced them (``owner``, at ``version``), and the jobs' LoRA adapters
    (job -> version) on the base."""

    base: str
    at_origin: bool
    owner: str | None
    version: int
    adapters: dict[str, int]

    def to_dict(self) -> dict[str, object]:
        return {
            "base": self.base,
            "at_origin": self.at_origin,
            "owner": self.owner,
            "version": self.version,
            "adapters": dict(self.adapters),
        }


class ModelRunner:
    """A base model and its tokenizer, what they serve (:class:`Holding`), and ``generate``,
    which runs one batch synchronously. Loading and generating must not overlap (the
    scheduler's lock).

    A job is served here in one of three ways: on the base weights (its version 0: a job
    with no adapter and no full weights loaded yet), with its LoRA adapter on the base, or
    with its full weights in place of the base (it then ``owns`` the runner, and no other
    job is served until :meth:`release` puts the base back). ``origin`` rebuilds the
    weights the runner started with (its model directory or preset); without it a copy of
    them is kept in memory. Requests without a job are the job ``""``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: ChatTokenizer,
        *,
        base: str = "",
        origin: Origin | None = None,
    ) -> None:
        self.tok = tokenizer
        self._set_model(model)
        self.origin_name = base
        self.base_name = base
        self.owner: str | None = None
        self.version = 0  # the owner's version; the base weights are every job's version 0
        # set by the scheduler's stop: a thread cannot be cancelled, and a generation of
        # thousands of tokens would hold the process's exit until it ends
        self.stopping = False
        self.adapters: dict[str, tuple[str, int]] = {}
        self._origin = origin
        # without ``origin``: an untouched copy of the model it started with (PEFT changes
        # the modules of the model it wraps, so a copy of the weights alone would not do)
        self._origin_copy = (copy.deepcopy(model), tokenizer) if origin is None else None

    def _set_model(self, model: torch.nn.Module) -> None:
        self.base = model.eval()
        self.model: torch.nn.Module = self.base  # a PeftModel around it once an adapter is loaded
        self.max_len = int(getattr(model.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    @property
    def at_origin(self) -> bool:
        return self.owner is None and self.base_name == self.origin_name

    def holding(self) -> Holding:
        return Holding(
            base=self.base_name,
            at_origin=self.at_origin,
            owner=self.owner,
            version=self.version,
            adapters={job: v for job, (_, v) in self.adapters.items()},
        )

    def serves(self, job_id: str | None) -> bool:
        return self.owner is None or self.owner == (job_id or "")

    def served(self, job_id: str | None) -> tuple[str | None, int]:
        """The adapter and version a request of ``job_id`` runs on now; :class:`NotServed`
        while another job's full weights are loaded."""
        job = job_id or ""
        if self.owner is not None:
            if job != self.owner:
                raise NotServed(f"this server holds job {self.owner!r}'s full weights, not job {job!r}'s")
            return None, self.version
        if job in self.adapters:
            return self.adapters[job]
        return None, 0

    def row(self, request: GenRequest, ticket: Any = None) -> Row:
        """The decoding state of ``request`` on what this runner serves its job now
        (:class:`NotServed` while another job's full weights are loaded)."""
        adapter, version = self.served(request.job_id)
        return Row(request, self.tok, version, self.max_len, adapter, ticket)

    @torch.inference_mode()
    def prefill(self, rows: list[Row]) -> Decoding:
        """``rows``' prompts through the model: a batch ready for its first token."""
        return Decoding(self.model, self.base, rows, self.tok.pad_id)

    @torch.inference_mode()
    def advance(self, batch: Decoding) -> list[Row]:
        """One token of every row of ``batch``; returns the rows that finished.
        :class:`Stopped` once the scheduler stops."""
        return batch.advance(lambda: self.stopping)

    def generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        """Run ``requests`` as one batch to their end."""
        rows = [self.row(request) for request in requests]
        live = [r for r in rows if r.finish is None]
        if live:
            batch = self.prefill(live)
            while batch.rows:
                self.advance(batch)
        return [r.output() for r in rows]

    # --- loading ----------------------------------------------------------------------------
    def load_weights(self, path: str | Path, version: int, job_id: str | None = None) -> float:
        """Load ``version`` for job ``job_id``; returns the switch time in seconds. A version
        directory from the registry (with its manifest) is checked first: a LoRA version
        becomes ``job_id``'s adapter, a full one ``job_id``'s weights in place of the base
        (without a ``job_id``, the job the manifest names; an evaluation job loads another
        job's version under its own id). Anything else (a safetensors file, a model
        directory) is ``job_id``'s full weights. :class:`NotServed` when another job holds
        the runner or (full weights) adapters are served on its base; nothing changes then."""
        t0 = time.perf_counter()
        p = Path(path)
        job = job_id or ""
        if p.is_dir() and (p / "manifest.json").is_file():
            manifest = verify_directory(p)  # CorruptVersion: refused, nothing changes
            if manifest.version != version:
                raise CorruptVersion(f"{p} holds version {manifest.version}, not {version}")
            job = job or manifest.job_id
            if manifest.kind == "lora":
                self.load_adapter(p, job_id=job, version=version)
                return time.perf_counter() - t0
        if self.owner not in (None, job):
            raise NotServed(f"this server holds job {self.owner!r}'s full weights; job {job!r} must wait")
        if self.adapters:
            raise NotServed(
                "full weights cannot replace the base model while LoRA adapters are served on it "
                f"(jobs {', '.join(sorted(self.adapters))})"
            )
        self._unwrap()
        if is_model_dir(p) and not self._same_shape(p):
            model, tok = load_model(p)
            self._set_model(model.to(self.device))
            self.tok = tok
        else:
            load_weights(self.base, p)
            self.base.eval()
        self.owner, self.version = job, version
        self.base_name = f"{job}-v{version}"
        return time.perf_counter() - t0

    def load_base(self, directory: str | Path | None, name: str) -> float:
        """Serve the model in ``directory`` as the base (named ``name``: the model the jobs
        name) for jobs' version 0 and their adapters; ``directory`` None: the weights the
        runner started with. Only a runner no job holds and with no adapter can change its
        base."""
        t0 = time.perf_counter()
        if self.owner is not None or self.adapters:
            raise NotServed(f"the base cannot change while {self._holders()} is served on it")
        if directory is None or name == self.origin_name:
            self.reset()
            return time.perf_counter() - t0
        model, tok = load_model(directory)
        self._unwrap()
        self._set_model(model.to(self.device))
        self.tok = tok
        self.base_name = name
        return time.perf_counter() - t0

    def release(self, job_id: str) -> float:
        """Unload ``job_id``'s adapter, or put the base back where the job's full weights
        were (the weights the runner started with). Returns the time it took."""
        t0 = time.perf_counter()
        current = self.adapters.pop(job_id, None)
        if current is not None:
            if self.adapters:
                # another adapter active first (PEFT warns when the active one is deleted;
                # generate names each row's adapter, so which one is active does not matter)
                self.model.set_adapter(next(iter(self.adapters.values()))[0])  # type: ignore[operator]
                self.model.delete_adapter(current[0])  # type: ignore[operator]
            else:
                self._unwrap(force=True)
        if self.owner == job_id:
            self.reset()
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Back to the weights the runner started with, no job and no adapter."""
        self.adapters.clear()
        self._unwrap(force=True)
        if self._origin is not None:
            model, tok = self._origin()
            self._set_model(model.to(self.device))
            self.tok = tok
        else:
            assert self._origin_copy is not None
            model, tok = self._origin_copy
            self._set_model(copy.deepcopy(model).to(self.device))
            self.tok = tok
        self.owner, self.version, self.base_name = None, 0, self.origin_name

    def _holders(self) -> str:
        if self.owner is not None:
            return f"job {self.owner!r}'s full weights"
        return "adapters of jobs " + ", ".join(sorted(self.adapters))

    def _unwrap(self, *, force: bool = False) -> None:
        """The base model without PEFT's layers (once no adapter is left on it)."""
        if self.model is self.base or (self.adapters and not force):
            return
        self.base = self.model.unload().eval()  # type: ignore[operator]
        self.model = self.base

    def _undo_adapter(self, name: str) -> None:
        """What a failed adapter load left behind goes: its layers, or (the first adapter on
        the base, whose PeftModel was never returned) every LoRA layer in the base."""
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            if name in self.model.peft_config:
                self.model.delete_adapter(name)  # type: ignore[operator]
        elif any(".lora_" in n for n, _ in self.base.named_parameters()):
            self.reset()

    def _same_shape(self, directory: Path) -> bool:
        config = json.loads((directory / "config.json").read_text())
        mine = cast(Any, self.base).config.to_dict()
        return all(config.get(k) == mine.get(k) for k in _SHAPE_FIELDS)

    def load_adapter(self, directory: str | Path, *, job_id: str, version: int) -> str:
        """Serve ``job_id`` with the PEFT adapter in ``directory`` as ``version`` (the
        job's previous adapter is dropped: no batch runs while this does). Returns its name."""
        from peft import PeftModel

        from temper.training.lora import peft_quiet

        if self.owner is not None:
            raise NotServed(f"this server holds job {self.owner!r}'s full weights; no adapter goes on them")
        current = self.adapters.get(job_id)
        if current is not None and current[1] >= version:
            return current[0]
        name = f"{job_id}-v{version}"
        # one load at a time in the process: peft_quiet's warning filter is process-wide,
        # and runners load in worker threads
        with _PEFT_LOCK, peft_quiet():
            try:
                if isinstance(self.model, PeftModel):
                    self.model.load_adapter(str(directory), adapter_name=name, is_trainable=False)
                else:
                    self.model = PeftModel.from_pretrained(
                        self.base, str(directory), adapter_name=name, is_trainable=False
                    )
            except BaseException:
                self._undo_adapter(name)
                raise
        self.adapters[job_id] = (name, version)
        self.model.to(self.device)  # the adapter's weights beside the base's (CUDA too)
        if current is not None:
            # the active adapter only matters without adapter_names, which generate always passes
            self.model.set_adapter(name)  # type: ignore[operator]
            self.model.delete_adapter(current[0])  # type: ignore[operator]
        self.model.eval()
        return name


def build_runner(*, model_dir: str | None = None, preset: str = "tiny", seed: int = 0) -> ModelRunner:
    """A runner on a model directory, or on a preset with weights drawn from ``seed``; its
    base is named by the directory or the preset, as jobs name the model (``policy.model``),
    and :meth:`ModelRunner.reset` rebuilds it the same way."""
    from temper.policy import create_model, default_tokenizer

    def origin() -> tuple[torch.nn.Module, ChatTokenizer]:
        if model_dir:
            return load_model(model_dir)
        return create_model(preset, seed=seed), default_tokenizer()

    model, tok = origin()
    return ModelRunner(model, tok, base=model_dir or preset, origin=origin)
