"""The ``reward_model`` reward component: an episode's transcript scored by a reward model.

A reward model is a model directory holding a sequence classifier with one output
(``AutoModelForSequenceClassification``), its tokenizer and chat template: what a
``reward_model`` job publishes (docs/training.md), or any such directory. The component
renders the episode's transcript (:mod:`temper.rewards.transcript`) with the model's own
template (:func:`temper.training.reward_model.encode`) and takes the model's output as the
value, unsquashed (a Bradley-Terry score: only differences mean something, which is what
a group's advantage uses).

Served in the scorer process, on the CPU or on a GPU where the process sees one
(``TEMPER_REWARD_SCORER__MODEL_DEVICE``): each model is loaded once; the transcripts of the
scores in flight are batched (whatever arrived while the previous forward ran, up to
``TEMPER_REWARD_SCORER__MODEL_BATCH`` in one forward); a score is cached by (transcript
digest, model digest, ``max_tokens``), so a redelivered or re-scored episode costs
nothing. ``details`` records the model, its digest and the transcript's digest, enough to
score it again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from temper import metrics
from temper.events import RewardComponent
from temper.rewards.components import Component, ScoreContext, Skip
from temper.rewards.graders import Graders, ModelNotFound
from temper.rewards.models import ComponentName

CACHE_SIZE = 100_000
MODELS_KEPT = 4


class RewardModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(
        min_length=1,
        max_length=1000,
        description="the reward model: a local model directory, a version in object storage, or "
        "job:<job>@v<N> / job:<job>@latest of a reward_model job (pinned to the version at submission)",
    )
    max_tokens: int = Field(
        2048, ge=16, le=1 << 20, description="a longer transcript keeps its last max_tokens tokens"
    )


@dataclass
class Loaded:
    """One reward model in memory, and the transcripts waiting for its next forward."""

    model: Any
    tok: Any
    digest: str
    device: Any
    max_batch: int
    pending: list[tuple[list[int], asyncio.Future[float]]] = field(default_factory=list)
    running: bool = False
    forwards: int = 0  # batches run (observability, tests)

    async def score(self, ids: list[int]) -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.pending.append((ids, future))
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Forward what is pending, a batch at a time; scores that arrive during a forward
        wait for the next one (so concurrent scores share forwards)."""
        try:
            await asyncio.sleep(0)  # the scores started together all enqueue first
            while self.pending:
                batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
                try:
                    values = await asyncio.to_thread(self._forward, [ids for ids, _ in batch])
                except Exception as exc:  # noqa: BLE001 - each waiting score gets the failure
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), value in zip(batch, values, strict=True):
                    if not future.done():
                        future.set_result(value)
        finally:
            self.running = False

    def _forward(self, rows: list[list[int]]) -> list[float]:
        import torch

        from temper.training.reward_model import sequence_scores

        with torch.no_grad():
            scores = sequence_scores(self.model, rows, self.tok.pad_id, self.device)
        self.forwards += 1
        metrics.REWARD_MODEL_BATCH.observe(len(rows))
        return [float(v) for v in scores.cpu()]


class RewardModel(Component):
    name = ComponentName.reward_model
    expensive = True  # a forward of a model: computed only when weighted
    settings_model = RewardModelSettings

    def __init__(self) -> None:
        self._models: OrderedDict[str, Loaded] = OrderedDict()
        self._loading: dict[str, asyncio.Lock] = {}
        self._cache: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        self.cache_hits = 0

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        settings: RewardModelSettings = self.settings(ctx)
        graders = ctx.graders or Graders()
        try:
            loaded = await self._model(graders, settings.model)
        except (ModelNotFound, ValueError, OSError) as exc:
            return RewardComponent(ok=False, reason=f"reward model {settings.model!r}: {exc}"[:500])
        transcript = await ctx.transcript()
        key = (transcript.digest(), loaded.digest, settings.max_tokens)
        details: dict[str, Any] = {
            "model": settings.model,
            "model_sha256": loaded.digest,
            "transcript_sha256": key[0],
            "max_tokens": settings.max_tokens,
        }
        if key in self._cache:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return RewardComponent(value=self._cache[key], details={**details, "cached": True})
        from temper.policy import TemplateError
        from temper.training.reward_model import encode

        try:
            ids = encode(loaded.tok, transcript.messages, max_tokens=settings.max_tokens)
        except TemplateError as exc:
            raise Skip(f"the reward model's chat template cannot render the transcript: {exc}") from None
        value = round(await loaded.score(ids), 6)
        self._cache[key] = value
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return RewardComponent(value=value, details={**details, "tokens": len(ids)})

    async def _model(self, graders: Graders, ref: str) -> Loaded:
        if ref in self._models:
            self._models.move_to_end(ref)
            return self._models[ref]
        async with self._loading.setdefault(ref, asyncio.Lock()):
            if ref not in self._models:
                directory, digest = await graders.model_dir(ref)
                self._models[ref] = await asyncio.to_thread(_load, directory, digest, graders)
                while len(self._models) > MODELS_KEPT:
                    self._models.popitem(last=False)
        return self._models[ref]


def _load(directory: Path, digest: str, graders: Graders) -> Loaded:
    from temper.training import pick_device
    from temper.training.reward_model import load

    model, tok = load(directory)
    device = pick_device(graders.device)
    return Loaded(model=model.to(device), tok=tok, digest=digest, device=device, max_batch=graders.max_batch)
