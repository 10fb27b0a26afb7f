"""The CPU model runner: batched token-in/token-out generation with a KV cache.

One batch at a time: prompts are left-padded, positions come from the attention mask,
and each step feeds one token per row through the cached model. Every request owns a
``torch.Generator`` seeded from its ``seed``, and sampling is done row by row with it,
so a request's tokens do not depend on which other requests share its batch.

The logprob reported for a sampled token is the raw model distribution's (log-softmax
of the logits, before temperature and top-p), as vLLM V1 reports by default
(``logprobs_mode=raw_logprobs``); ``temper.policy.token_logprobs`` recomputes exactly
this from a forward pass.

Many jobs share one base model: each job's policy is a LoRA adapter (PEFT) named
``<job>-v<version>``, chosen per request by ``job_id``. Requests of different jobs run
in the same batch: PEFT's ``adapter_names`` applies each row's own adapter inside every
LoRA layer (rows without an adapter get ``__base__``, the base model), so one forward
step serves every adapter at once. Every output carries the version of the adapter (or
base weights) that produced it. A full-weights version replaces the base weights.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from temper.policy import ChatTokenizer, forward, load_weights, pad_batch
from temper.registry import CorruptVersion, verify_directory

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    job_id: str | None = None  # picks the job's adapter; none loaded: the base weights


@dataclass
class GenOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None
    policy_version: int
    adapter: str | None = None  # the LoRA adapter that produced it; None: the base weights


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """One token from a row of logits ``[V]``; returns ``(token, raw logprob)``."""
    raw = torch.log_softmax(logits, dim=-1)
    if params.temperature <= 1e-5:
        tok = int(torch.argmax(logits))
        return tok, float(raw[tok])
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = torch.where(before < params.top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(raw[tok])


class _Row:
    """The decoding state of one request inside a batch."""

    def __init__(
        self, req: GenRequest, tok: ChatTokenizer, version: int, max_len: int, adapter: str | None = None
    ) -> None:
        self.req = req
        self.p = req.params
        seed = self.p.seed if self.p.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.stop_ids = set(self.p.stop_token_ids)
        self.eos_ids = set() if self.p.ignore_eos else set(tok.stop_ids)
        self.budget = max(0, min(self.p.max_tokens, max_len - len(req.prompt_ids)))
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish: str | None = None if self.budget > 0 else "length"
        self.stop_reason: int | str | None = None
        self.version = version
        self.adapter = adapter
        self.tok = tok

    def push(self, token: int, logprob: float) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish, self.stop_reason = "stop", token
        elif token in self.eos_ids:
            self.finish = "stop"
        if self.p.stop and self.finish is None:
            text = self.tok.decode(self.ids)
            for s in self.p.stop:
                at = text.find(s)
                if at >= 0:
                    self.finish, self.stop_reason, self.text = "stop", s, text[:at]
                    return
        if self.finish is None and len(self.ids) >= self.budget:
            self.finish = "length"

    def output(self) -> GenOutput:
        text = self.text if isinstance(self.stop_reason, str) else self.tok.decode(self.ids)
        return GenOutput(
            prompt_ids=list(self.req.prompt_ids),
            token_ids=self.ids,
            logprobs=self.logprobs,
            text=text,
            finish_reason=self.finish or "length",
            stop_reason=self.stop_reason,
            policy_version=self.version,
            adapter=self.adapter,
        )


BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class ModelRunner:
    """A base model, its tokenizer, the base weights' policy version and the jobs' LoRA
    adapters (``adapters``: job -> (adapter name, version)); ``generate`` runs one batch
    synchronously. Loading and generating must not overlap (the scheduler's lock)."""

    def __init__(self, model: torch.nn.Module, tokenizer: ChatTokenizer, *, version: int = 0) -> None:
        self.base = model.eval()
        self.model: torch.nn.Module = self.base  # a PeftModel around it once an adapter is loaded
        self.tok = tokenizer
        self.version = version
        self.max_len = int(getattr(model.config, "max_position_embeddings", 2048))
        self.adapters: dict[str, tuple[str, int]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    def served(self, job_id: str | None) -> tuple[str | None, int]:
        """The adapter and version a request of ``job_id`` runs on now."""
        if job_id is not None and job_id in self.adapters:
            return self.adapters[job_id]
        return None, self.version

    def served_versions(self) -> dict[str, int]:
        return {job: v for job, (_, v) in self.adapters.items()}

    @torch.inference_mode()
    def generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        rows: list[_Row] = []
        for request in requests:
            adapter, version = self.served(request.job_id)
            rows.append(_Row(request, self.tok, version, self.max_len, adapter))
        live = [r for r in rows if r.finish is None]
        if not live:
            return [r.output() for r in rows]
        for r in live:
            if not r.req.prompt_ids:
                raise ValueError("empty prompt")
        dev = self.device
        ids, mask = pad_batch([r.req.prompt_ids for r in live], self.tok.pad_id, left=True)
        ids, mask = ids.to(dev), mask.to(dev)
        names = [r.adapter or BASE_ADAPTER for r in live] if self.model is not self.base else None
        logits, cache = forward(self.model, ids, mask, use_cache=True, adapter_names=names)
        pos = (mask.sum(-1, keepdim=True) - 1).clamp(min=0)
        while True:
            nxt = torch.full((len(live), 1), self.tok.pad_id, dtype=torch.long)
            # sampling runs on the CPU with each request's own generator (on CUDA too)
            last = logits[:, -1].float().cpu()
            for i, r in enumerate(live):
                if r.finish is None:
                    t, lp = sample_token(last[i], r.p, r.gen)
                    r.push(t, lp)
                    nxt[i, 0] = t
            if all(r.finish is not None for r in live):
                break
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=dev)], dim=1)
            pos = pos + 1
            logits, cache = forward(
                self.model,
                nxt.to(dev),
                mask,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                adapter_names=names,
            )
        return [r.output() for r in rows]

    def load_weights(self, path: str | Path, version: int) -> float:
        """Swap in new base weights (same architecture); returns the switch time in seconds.
        A version directory from the registry (with its manifest) is checked first, and a
        LoRA version is loaded as its job's adapter instead."""
        t0 = time.perf_counter()
        p = Path(path)
        if p.is_dir() and (p / "manifest.json").is_file():
            manifest = verify_directory(p)  # CorruptVersion: refused, nothing changes
            if manifest.version != version:
                raise CorruptVersion(f"{p} holds version {manifest.version}, not {version}")
            if manifest.kind == "lora":
                self.load_adapter(p, job_id=manifest.job_id, version=version)
                return time.perf_counter() - t0
        if self.adapters:
            raise ValueError(
                "full weights cannot replace the base model while LoRA adapters are served on it"
            )
        load_weights(self.base, path)
        self.base.eval()
        self.version = version
        return time.perf_counter() - t0

    def load_adapter(self, directory: str | Path, *, job_id: str, version: int) -> str:
        """Serve ``job_id`` with the PEFT adapter in ``directory`` as ``version`` (the
        job's previous adapter is dropped: no batch runs while this does). Returns its name."""
        from peft import PeftModel

        from temper.training.lora import peft_quiet

        current = self.adapters.get(job_id)
        if current is not None and current[1] >= version:
            return current[0]
        name = f"{job_id}-v{version}"
        with peft_quiet():
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(str(directory), adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(
                    self.base, str(directory), adapter_name=name, is_trainable=False
                )
        self.adapters[job_id] = (name, version)
        self.model.to(self.device)  # the adapter's weights beside the base's (CUDA too)
        if current is not None:
            # the active adapter only matters without adapter_names, which generate always passes
            self.model.set_adapter(name)  # type: ignore[operator]
            self.model.delete_adapter(current[0])  # type: ignore[operator]
        self.model.eval()
        return name
