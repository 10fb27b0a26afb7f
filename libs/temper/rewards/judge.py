"""The ``judge`` reward component (RLAIF): a language model served by the inference gateway
grades the episode's transcript against a rubric, and its verdict is the value.

The rubric is the job's (``prompt``): a text in which ``{transcript}`` (the episode as
``User: ... / Assistant: ... / Tool: ...``, :meth:`temper.rewards.transcript.Transcript.as_text`),
``{task}`` (the task's prompt) and ``{reply}`` (the model's last reply) are filled in; it
is sent as one user message, rendered by the judge model's own chat template, greedy by
default. The question goes to the gateway the way the dispatcher's turns do (an
:class:`temper.events.InferenceRequest` on ``inference.requests``), with ``reply_to:
judge.results``; the gateway routes it to a backend serving the judge model, never to the
job's policy unless ``model: policy`` asks for it.

The verdict's format is strict: its last non-empty line must match ``pattern`` (default
``Score: <number>``) with the number within ``[min_score, max_score]``; the value is the
score scaled to [0, 1]. Anything else is an unparsable verdict: recorded (the verdict's
text in ``details``), never guessed, and not rewarded (``ok`` false: the weighted sum
leaves it out, and the job's reward says it is missing). A question the gateway does not
answer within ``timeout_s`` (or answers with an error) is asked again, ``retries`` times.
``details`` of every score carry the rubric, the rendered prompt's SHA-256, the judge model
and what the gateway says it served (its version, or the model's digest), the sampling and
the verdict, so a re-score is reproducible; scores are cached by (rendered prompt, judge
model, sampling), not for ``model: policy`` (a new version is a new judge).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from temper import metrics, registry
from temper.events import InferenceRequest, RewardComponent, SamplingParams, Topics
from temper.policy.placement import is_model_ref
from temper.provenance import directory_files, local_dir, tree_digest
from temper.rewards.components import Component, ScoreContext, Skip
from temper.rewards.graders import Graders, text_digest
from temper.rewards.models import ComponentName

POLICY = "policy"
PLACEHOLDERS = ("{transcript}", "{task}", "{reply}")
DEFAULT_PATTERN = r"Score: (-?[0-9]+(?:\.[0-9]+)?)"
CACHE_SIZE = 100_000
VERDICT_KEPT = 2000  # characters of a verdict kept in details


class JudgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(
        min_length=1,
        max_length=1000,
        description="the judge: a model the gateway serves by name, a model directory, a version in object "
        "storage, job:<job>@v<N> / @latest of a job of yours (pinned at submission), or policy (the job's own "
        "policy at its current version)",
    )
    prompt: str = Field(
        min_length=1,
        max_length=100_000,
        description="the rubric: {transcript}, {task} and {reply} are filled in; asked as one user message",
    )
    pool: str = Field(
        "default", max_length=200, description="the gateway's backend pool that serves the judge"
    )
    pattern: str = Field(
        DEFAULT_PATTERN,
        max_length=500,
        description="a regular expression with one group, the score: the verdict's last non-empty line must "
        "match it whole",
    )
    min_score: float = Field(0.0, description="the lowest score (value 0)")
    max_score: float = Field(10.0, description="the highest score (value 1)")
    max_tokens: int = Field(256, ge=1, le=32768, description="tokens the judge may write")
    temperature: float = Field(0.0, ge=0, le=5, description="0: greedy")
    seed: int | None = Field(None, description="the sampling seed (with temperature > 0)")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="how long one question may take")
    retries: int = Field(
        2, ge=0, le=10, description="questions asked again after a timeout or a gateway error"
    )

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        if compiled.groups != 1:
            raise ValueError(f"needs exactly one group (the score), has {compiled.groups}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JudgeSettings:
        if not any(p in self.prompt for p in PLACEHOLDERS):
            raise ValueError("prompt: the rubric names nothing to grade: put {transcript} or {reply} in it")
        if self.max_score <= self.min_score:
            raise ValueError("max_score must be above min_score")
        return self


def render_rubric(rubric: str, *, transcript: str, task: str, reply: str) -> str:
    """The rubric with its placeholders filled in (nothing else in it is interpreted, so a
    rubric may hold braces of its own)."""
    return rubric.replace("{transcript}", transcript).replace("{task}", task).replace("{reply}", reply)


def parse_verdict(text: str, pattern: str, low: float, high: float) -> tuple[float | None, str]:
    """(score, '') from a verdict whose last non-empty line matches ``pattern`` with a
    number in [low, high]; (None, why) otherwise."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None, "the verdict is empty"
    match = re.fullmatch(pattern, lines[-1])
    if match is None:
        return None, f"the last line {lines[-1][:200]!r} does not match {pattern!r}"
    try:
        score = float(match.group(1))
    except ValueError:
        return None, f"{match.group(1)!r} is not a number"
    if not low <= score <= high:
        return None, f"the score {score:g} is outside [{low:g}, {high:g}]"
    return score, ""


class Judge(Component):
    name = ComponentName.judge
    expensive = True  # a question to a model: asked only when weighted
    settings_model = JudgeSettings

    def __init__(self) -> None:
        self._cache: OrderedDict[str, RewardComponent] = OrderedDict()
        self._digests: dict[str, str | None] = {}
        self.asked = 0  # questions sent to the gateway (tests, observability)

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        s: JudgeSettings = self.settings(ctx)
        graders = ctx.graders or Graders()
        if graders.ask is None:
            raise Skip("this scorer has no way to the inference gateway to ask a judge")
        transcript = await ctx.transcript()
        request, tok = await self._request(ctx, s, graders)
        text = render_rubric(
            s.prompt, transcript=transcript.as_text(), task=ctx.task.prompt, reply=transcript.last_reply()
        )
        request.prompt_ids = tok.render([{"role": "user", "content": text}], add_generation_prompt=True)
        sampling = request.sampling.model_dump(mode="json", exclude={"stop_token_ids"})
        details: dict[str, Any] = {
            "model": s.model,
            "prompt": s.prompt,
            "prompt_sha256": text_digest(text),
            "prompt_tokens": len(request.prompt_ids),
            "transcript_sha256": transcript.digest(),
            "sampling": sampling,
            "pattern": s.pattern,
            "scale": [s.min_score, s.max_score],
        }
        key = None
        if s.model != POLICY:
            details["model_sha256"] = await self._digest(graders, s.model)
            key = text_digest(details["prompt_sha256"], s.model, details["model_sha256"], sampling, s.pattern,
                              s.min_score, s.max_score)  # fmt: skip
            if key in self._cache:
                self._cache.move_to_end(key)
                hit = self._cache[key]
                metrics.JUDGE_VERDICTS.labels(outcome="cached").inc()
                return hit.model_copy(update={"details": {**hit.details, "cached": True}})
        result = await self._component(graders, request, s, details)
        outcome = "scored" if result.ok else ("unparsable" if "verdict" in result.details else "no_answer")
        metrics.JUDGE_VERDICTS.labels(outcome=outcome).inc()
        if key is not None and (result.ok or "verdict" in result.details):  # a verdict, not an outage
            self._cache[key] = result
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return result

    async def _component(
        self, graders: Graders, request: InferenceRequest, s: JudgeSettings, details: dict[str, Any]
    ) -> RewardComponent:
        assert graders.ask is not None
        problems: list[str] = []
        for attempt in range(s.retries + 1):
            asked = request.model_copy(update={"attempt": attempt})
            t0 = time.perf_counter()
            self.asked += 1
            try:
                answer = await graders.ask(asked, s.timeout_s)
            except TimeoutError:
                problems.append(f"attempt {attempt + 1}: no answer in {s.timeout_s:g}s")
                continue
            if answer.error is not None:
                problems.append(f"attempt {attempt + 1}: {answer.error[:200]}")
                continue
            details.update(
                attempts=attempt + 1,
                seconds=round(time.perf_counter() - t0, 4),
                served_version=answer.policy_version,
                backend=answer.backend,
                verdict=answer.text[:VERDICT_KEPT],
            )
            score, why = parse_verdict(answer.text, s.pattern, s.min_score, s.max_score)
            if score is None:
                return RewardComponent(ok=False, reason=f"unparsable verdict: {why}", details=details)
            details["score"] = score
            value = (score - s.min_score) / (s.max_score - s.min_score)
            return RewardComponent(value=round(value, 6), details=details)
        details["attempts"] = s.retries + 1
        return RewardComponent(
            ok=False, reason=f"the judge did not answer: {'; '.join(problems)}"[:500], details=details
        )

    async def _request(
        self, ctx: ScoreContext, s: JudgeSettings, graders: Graders
    ) -> tuple[InferenceRequest, Any]:
        """The question's envelope (the model it names, its pool, its sampling) and the
        judge model's tokenizer, which renders it."""
        from temper.policy.tokenizer import assistant_stop_ids, fetch_policy_tokenizer, policy_tokenizer

        if s.model == POLICY:
            policy = ctx.policy or {}
            if not ctx.job_id or not policy.get("model"):
                raise Skip("model: policy needs the episode's job and its policy")
            model, init, pool, job = (
                policy["model"],
                policy.get("init"),
                policy.get("backend_pool", "default"),
                ctx.job_id,
            )
        else:
            # a model of its own, asked under an id of its own: the gateway never routes it to a job's weights
            init = s.model if is_model_ref(s.model) else None  # a directory or prefix: the weights to load
            model, pool, job = s.model, s.pool, f"judge-{text_digest(s.model)[:16]}"
        if graders.store is not None:
            await fetch_policy_tokenizer(graders.store, model, init, graders.cache() / "tokenizers")
        tok = await asyncio.to_thread(policy_tokenizer, model, init)
        sampling = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            seed=s.seed,
            stop_token_ids=assistant_stop_ids(tok),
        )
        request = InferenceRequest(
            job_id=job, episode_id=f"judge-{uuid.uuid4().hex}", turn=0, kind="judge",
            model=model, init=init, pool=pool, prompt_ids=[], sampling=sampling, reply_to=Topics.JUDGE_RESULTS,
        )  # fmt: skip
        return request, tok

    async def _digest(self, graders: Graders, ref: str) -> str | None:
        """The judge model's digest where its files can be seen from here (a directory, a
        version in object storage); None for a model named only by the gateway's backends."""
        if ref not in self._digests:
            digest: str | None = None
            directory = local_dir(ref)
            if directory is not None:
                digest = tree_digest(await asyncio.to_thread(directory_files, directory))
            elif graders.store is not None and ref.startswith("tenants/"):
                try:
                    manifest = await registry.read_manifest(graders.store, registry.manifest_key(ref))
                    digest = tree_digest({n: manifest.files[n].sha256 for n in manifest.served_files()})
                except registry.CorruptVersion:
                    digest = None
            self._digests[ref] = digest
        return self._digests[ref]
