"""Scoring a reward request once: ``reward.requests`` in, ``reward.results`` out.

Idempotent: every scored request leaves a durable record in the object store under
``rewards/<job>/<episode>/t<turn>-a<attempt>.json`` (the request and its result). A
redelivered request with the same (episode, turn, attempt) finds its record and the
stored result is published again, never re-scored. Scoring runs at most
``concurrency`` submissions at once, each component in fresh sandboxes from the
scorer's own pool (never the agent's sandbox). It writes nothing to the database: whether
the episode solved its task is recorded by the dispatcher when it takes the result.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import tarfile
import time
from collections import OrderedDict
from typing import Any

from sqlalchemy import select

from temper import faults, metrics
from temper.db import Database, Episode, Job
from temper.envpkg import grader as envpkg_grader
from temper.episode_steps import read_steps
from temper.events import RewardRequest, RewardResult
from temper.logs import log_event
from temper.rewards import Scorer, ScoringError, Skip
from temper.rewards import transcript as transcripts
from temper.rewards.graders import Graders
from temper.rewards.models import load_submission
from temper.rewards.transcript import Transcript
from temper.sandbox import SandboxManager
from temper.storage import NotFound, ObjectStore
from temper.storage.base import check_key
from temper.tasks import service as tasks
from temper.tasks.models import TaskSpec

log = logging.getLogger("temper.reward_scorer")


def record_key(
    job_id: str | None, episode_id: str | None, turn: int | None, attempt: int, fallback: str
) -> str:
    def part(value: str | None, default: str) -> str:
        text = (value or default).replace("/", "_")
        return text[:120]

    return check_key(
        f"rewards/{part(job_id, 'no-job')}/{part(episode_id, fallback)}/t{turn or 0}-a{attempt}.json"
    )


def init_metrics() -> None:
    """This service's outcomes and its own failure reasons export 0 from the start (metrics.zero
    says why); a component's failures (temper.rewards.scorer) add their series when they occur."""
    metrics.zero(metrics.REWARDS_SCORED, "ok", "error", "duplicate")
    metrics.zero(metrics.REWARD_FAILURES, ("*", "unknown_task"), ("*", "bad_submission"))


class SubmissionScorer:
    """Scores submissions with ``manager``'s fresh sandboxes, at most ``concurrency`` at
    once, and keeps each request's record in ``store``; tasks are read from ``db`` and
    the last ``task_cache`` are kept."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        manager: SandboxManager,
        *,
        concurrency: int,
        task_cache: int = 2048,
        graders: Graders | None = None,
    ) -> None:
        init_metrics()
        self.db = db
        self._store = store
        self.manager = manager
        self.scorer = Scorer(manager, graders=graders or Graders(store=store))
        self._gate = asyncio.Semaphore(concurrency)
        self._inflight: dict[str, asyncio.Lock] = {}
        self._tasks: OrderedDict[str, TaskSpec] = OrderedDict()
        self._policies: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._task_cache = task_cache
        self.scored = 0
        self.duplicates = 0

    @property
    def store(self) -> ObjectStore:
        return self._store

    async def task(self, task_id: str) -> TaskSpec:
        if task_id in self._tasks:
            self._tasks.move_to_end(task_id)
            return self._tasks[task_id]
        async with self.db.session() as session:
            spec = await tasks.load_task(session, task_id)
        self._tasks[task_id] = spec
        while len(self._tasks) > self._task_cache:
            self._tasks.popitem(last=False)
        return spec

    async def policy_of(self, job_id: str | None) -> dict[str, Any] | None:
        """The job spec's ``policy`` block (a judge with ``model: policy`` asks that model), kept per job."""
        if not job_id:
            return None
        if job_id not in self._policies:
            async with self.db.session() as session:
                spec = await session.scalar(select(Job.spec).where(Job.id == job_id))
            self._policies[job_id] = dict((spec or {}).get("policy") or {})
            while len(self._policies) > self._task_cache:
                self._policies.popitem(last=False)
        return self._policies[job_id]

    async def transcript(self, request: RewardRequest, task: TaskSpec) -> Transcript:
        """The episode's conversation, from its steps (read only when a component asks)."""
        if not request.episode_id:
            raise Skip("the request names no episode to read a transcript from")
        async with self.db.session() as session:
            episode = await session.get(Episode, request.episode_id)
            if episode is None:
                raise Skip(f"no episode {request.episode_id} to read a transcript from")
            job_spec = await session.scalar(select(Job.spec).where(Job.id == episode.job_id))
            steps = await read_steps(session, self.store, episode)
        tool_role = ((job_spec or {}).get("environment") or {}).get("tool_role") or "tool"
        return transcripts.from_steps(task.prompt, steps, tool_role=tool_role)

    async def result_for(self, request: RewardRequest) -> RewardResult:
        """The result of ``request``: the stored one for a redelivery, else a new score,
        recorded before it is returned. Concurrent deliveries of one request score once."""
        key = record_key(request.job_id, request.episode_id, request.turn, request.attempt, str(request.id))
        lock = self._inflight.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._recorded_or_scored(request, key)
        finally:
            if not lock.locked():
                self._inflight.pop(key, None)

    async def _recorded_or_scored(self, request: RewardRequest, key: str) -> RewardResult:
        try:
            stored = json.loads(await self.store.get(key))
        except NotFound:
            stored = None
        if stored is not None:
            self.duplicates += 1
            metrics.REWARDS_SCORED.labels(status="duplicate").inc()
            log_event(log, "reward request redelivered; publishing the stored result", key=key)
            return RewardResult.model_validate(stored["result"])
        async with self._gate:
            result = await self.score(request)
            await faults.hold("scorer.score", job_id=request.job_id, episode_id=request.episode_id)
        record = {"request": request.model_dump(mode="json"), "result": result.model_dump(mode="json")}
        await self.store.put(key, json.dumps(record).encode(), "application/json")
        return result

    async def score(self, request: RewardRequest) -> RewardResult:
        ids: dict[str, Any] = {
            "job_id": request.job_id, "episode_id": request.episode_id, "turn": request.turn,
            "attempt": request.attempt, "task_id": request.task_id,
        }  # fmt: skip
        t0 = time.perf_counter()
        try:
            task = await self.task(request.task_id)
        except LookupError as exc:
            metrics.REWARDS_SCORED.labels(status="error").inc()
            metrics.REWARD_FAILURES.labels(component="*", reason="unknown_task").inc()
            return RewardResult(**ids, error=str(exc))
        try:
            if request.submission.get("kind") == "package":  # a tenant package: its grade program decides
                reward, components = await envpkg_grader.grade(
                    self.manager, self.store, task, request.submission
                )
            else:
                submission = await load_submission(request.submission, self.store)
                reward, components = await self.scorer.score(
                    task, submission, request.weights or None, turns_used=request.turns_used,
                    max_turns=request.max_turns, format_ok=request.format_ok, settings=request.settings,
                    transcript=functools.partial(self.transcript, request, task), job_id=request.job_id,
                    policy=await self.policy_of(request.job_id),
                )  # fmt: skip
        except ScoringError as exc:
            metrics.REWARDS_SCORED.labels(status="error").inc()
            return RewardResult(**ids, error=f"scoring failed: {exc}")
        except (ValueError, NotFound, tarfile.TarError, EOFError) as exc:
            metrics.REWARDS_SCORED.labels(status="error").inc()
            metrics.REWARD_FAILURES.labels(component="*", reason="bad_submission").inc()
            return RewardResult(**ids, error=f"bad submission: {exc}")
        self.scored += 1
        metrics.REWARDS_SCORED.labels(status="ok").inc()
        log_event(
            log, "scored", task_id=request.task_id, reward=reward, seconds=round(time.perf_counter() - t0, 4)
        )
        return RewardResult(**ids, reward=reward, components=components)
