"""Decoding for the CPU model runner: the rows of a running batch, their KV cache, one
token at a time, and rows that join or leave the batch between two tokens.

Prompts are left-padded and positions come from the attention mask. A batch that is
running takes new rows at its next token (:meth:`Decoding.join`): their prompts are run
on their own (the prefill), then their cache is put beside the batch's, both left-padded
to the longer one, so each row attends only to its own tokens. A finished row leaves at
once (:meth:`Decoding.advance`) and the columns no row needs any more are cut.

Every request owns a ``torch.Generator`` seeded from its ``seed`` and draws one number
from it per token; the token is where that number falls in the request's own
distribution. So a request's tokens do not depend on which other requests share its
batch, or when they joined it. The logprob reported for a sampled token is the raw
model distribution's (log-softmax of the logits, before temperature and top-p), as vLLM V1
reports by default (``logprobs_mode=raw_logprobs``); ``temper.policy.token_logprobs``
recomputes exactly this from a forward pass.

A row of a partial-rollout request (``GenRequest.partial_rollout``) can leave the batch
before it is done (the scheduler cuts it when its job's next version waits to load) and
go on later from its prefix: its next prefill reads its prompt and the tokens it sampled
(:attr:`Row.context`), on the weights served then. Every token records the version that
sampled it (``Row.versions``, ``GenOutput.token_versions``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from temper.policy import ChatTokenizer, forward, pad_batch

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


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
    partial_rollout: bool = False  # may be cut by the job's next version and go on on it


@dataclass
class GenOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None
    policy_version: int  # the version that sampled the last token
    adapter: str | None = None  # the LoRA adapter that produced it; None: the base weights
    token_versions: list[int] = field(default_factory=list)  # the version that sampled each token
    interruptions: int = 0  # times a new version cut it (partial rollouts)


class Row:
    """The decoding state of one request; ``ticket`` is the caller's (the scheduler keeps
    the request's future there)."""

    def __init__(
        self,
        req: GenRequest,
        tok: ChatTokenizer,
        version: int,
        max_len: int,
        adapter: str | None = None,
        ticket: Any = None,
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
        self.versions: list[int] = []  # the version that sampled each token
        self.interruptions = 0  # times it was cut for a new version (and went on on it)
        self.text = ""
        self.finish: str | None = None if self.budget > 0 else "length"
        self.stop_reason: int | str | None = None
        self.version = version
        self.adapter = adapter
        self.tok = tok
        self.ticket = ticket

    @property
    def context(self) -> list[int]:
        """What the model reads before the row's next token: its prompt and the tokens it
        sampled so far (a row that goes on after a cut is prefilled with these)."""
        return [*self.req.prompt_ids, *self.ids]

    def resume_on(self, version: int, adapter: str | None) -> None:
        """The row was cut (:attr:`interruptions`) and goes on on these weights."""
        self.interruptions += 1
        self.version, self.adapter = version, adapter

    def push(self, token: int, logprob: float) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(self.version)
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
            token_versions=list(self.versions),
            interruptions=self.interruptions,
        )


def sample(rows: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token per row from ``logits`` ``[B, V]`` (on the CPU): greedy where the
    temperature is ~0, else the point its generator draws in its tempered, top-p-cut
    distribution. Returns the tokens and their raw logprobs."""
    raw = torch.log_softmax(logits, dim=-1)
    temps = torch.tensor([max(r.p.temperature, 1e-5) for r in rows], dtype=logits.dtype).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    top_p = torch.tensor([r.p.top_p for r in rows], dtype=probs.dtype).unsqueeze(1)
    if bool((top_p < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = torch.where((before < top_p) | (top_p >= 1.0), sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    cdf = torch.cumsum(probs.double(), dim=-1)
    draws = torch.cat([torch.rand(1, generator=r.gen, dtype=torch.float64) for r in rows]).unsqueeze(1)
    # the first token whose cumulated mass passes the draw (scaled: the sum may be 1 - 1e-7)
    picked = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True).clamp(max=logits.shape[-1] - 1)
    greedy = torch.tensor([r.p.temperature <= 1e-5 for r in rows]).unsqueeze(1)
    picked = torch.where(greedy, logits.argmax(dim=-1, keepdim=True), picked)
    return picked.squeeze(1).tolist(), raw.gather(1, picked).squeeze(1).tolist()


def joinable(cache: Any) -> bool:
    """Can another batch's cache be put beside this one (every layer a plain growing one,
    not a sliding window or a state space)?"""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache):
        return False
    layers = list(getattr(cache, "layers", None) or [])
    return bool(layers) and all(type(x) is DynamicLayer for x in layers)


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Decoding:
    """Rows decoded together on one model: their cache, attention mask ``[B, T]``, the
    position of each row's last token and the logits of each row's next token."""

    def __init__(self, model: torch.nn.Module, base: torch.nn.Module, rows: list[Row], pad_id: int) -> None:
        """The prefill: ``rows``' prompts (and the tokens a row that was cut had sampled) through ``model`` (``base`` is the model without
        PEFT's layers; a row's adapter applies when they differ)."""
        for r in rows:
            if not r.req.prompt_ids:
                raise ValueError("empty prompt")
        self.model = model
        self.peft = model is not base
        self.pad_id = pad_id
        self.rows = rows
        dev = next(base.parameters()).device
        # A group's samples come with one prompt: each distinct (context, adapter) runs
        # once and its cache is copied to the rows that share it.
        names = self._names()
        distinct: dict[tuple[tuple[int, ...], str], int] = {}
        of_row = [
            distinct.setdefault((tuple(r.context), names[i] if names else ""), len(distinct))
            for i, r in enumerate(rows)
        ]
        ids, mask = pad_batch([list(c) for c, _ in distinct], pad_id, left=True)
        mask = mask.to(dev)
        logits, self.cache = forward(
            model,
            ids.to(dev),
            mask,
            use_cache=True,
            adapter_names=[a for _, a in distinct] if names else None,
        )
        last = logits[:, -1]
        if len(distinct) < len(rows):
            idx = torch.tensor(of_row, dtype=torch.long, device=dev)
            self.cache.batch_select_indices(idx)
            mask, last = mask.index_select(0, idx), last.index_select(0, idx)
        self.mask = mask
        # a plain growing cache under SDPA takes a boolean 4-D mask as it is (a sliding
        # window's or eager attention's masks are the model's to build)
        config = getattr(model, "config", None)
        self._mask_as_is = self.can_join and getattr(config, "_attn_implementation", None) == "sdpa"
        self.pos = (self.mask.sum(-1, keepdim=True) - 1).clamp(min=0)
        self.last = last.float().cpu()  # sampling runs on the CPU with each row's own generator

    def _names(self) -> list[str] | None:
        return [r.adapter or BASE_ADAPTER for r in self.rows] if self.peft else None

    @property
    def can_join(self) -> bool:
        return joinable(self.cache)

    def join(self, other: Decoding) -> None:
        """``other``'s rows (prefilled on the same model) go on in this batch from the next token."""
        if not (self.can_join and other.can_join):
            raise ValueError("these caches cannot be joined")
        a, b = self.mask.shape[1], other.mask.shape[1]
        width = max(a, b)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width - a, 2), _pad_left(theirs.keys, width - b, 2)])
            mine.values = torch.cat(
                [_pad_left(mine.values, width - a, 2), _pad_left(theirs.values, width - b, 2)]
            )
        self.mask = torch.cat([_pad_left(self.mask, width - a, 1), _pad_left(other.mask, width - b, 1)])
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        self.rows = self.rows + other.rows

    def advance(self, stopping: Callable[[], bool]) -> list[Row]:
        """Sample one token for every row; returns the rows that finished (they leave the
        batch), then runs the others' tokens through the model. ``stopping`` is asked
        before the forward pass: True raises :class:`Stopped`."""
        tokens, logprobs = sample(self.rows, self.last)
        for r, t, lp in zip(self.rows, tokens, logprobs, strict=True):
            r.push(t, lp)
        done = [r for r in self.rows if r.finish is not None]
        if done:
            keep = [i for i, r in enumerate(self.rows) if r.finish is None]
            self._select(keep)
            tokens = [tokens[i] for i in keep]
        if self.rows:
            if stopping():
                raise Stopped("the model runner is stopping: generation abandoned")
            dev = self.mask.device
            self.mask = torch.cat(
                [self.mask, torch.ones((len(self.rows), 1), dtype=self.mask.dtype, device=dev)], 1
            )
            self.pos = self.pos + 1
            nxt = torch.tensor(tokens, dtype=torch.long, device=dev).unsqueeze(1)
            # one new token a row: its mask is the row's columns, so the model need not build
            # a [B, 1, 1, T] mask from the 2-D one at every token (a tenth of a decode step)
            attention = self.mask[:, None, None, :].bool() if self._mask_as_is else self.mask
            logits, self.cache = forward(
                self.model, nxt, attention, position_ids=self.pos, cache=self.cache, use_cache=True,
                adapter_names=self._names(),
            )  # fmt: skip
            self.last = logits[:, -1].float().cpu()
        return done

    def remove(self, rows: list[Row]) -> None:
        """``rows`` leave the batch before they are done (they may go on in another one)."""
        gone = {id(r) for r in rows}
        self._select([i for i, r in enumerate(self.rows) if id(r) not in gone])

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows, and cut the columns on the left that none of them uses."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        self.pos = self.pos.index_select(0, idx)
        self.last = self.last.index_select(0, idx.cpu())
        if not self.can_join:  # a sliding window's cache has columns of its own: rows only
            self.cache.batch_select_indices(idx)
            return
        used = self.mask.any(dim=0).nonzero()
        cut = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, cut:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, cut:]
            layer.values = layer.values.index_select(0, idx)[:, :, cut:]


class Stopped(RuntimeError):
    """The runner is stopping: a generation in progress is abandoned between two tokens
    (its request is not answered, so the bus gives it to another replica)."""


__all__ = [
    "BASE_ADAPTER",
    "Decoding",
    "GenOutput",
    "GenRequest",
    "Row",
    "SamplingParams",
    "Stopped",
    "sample",
]
