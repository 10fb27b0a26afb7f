"""What a job's rows contain, checked against what produced them (the chaos runs' content
checks, beside the counts of ``chaos.py``):

- **Versions**: every version the gateway tagged a result with is in the registry for that
  job (a ``policy_versions`` row of the job whose manifest names the job and the version;
  0 is the job's starting model).
- **Logprobs**: each model turn of each stored trajectory is recomputed under the weights of
  the version it is labelled with (the job's base model, its full weights, or the base with
  its PEFT adapter, all loaded here from the registry, not from the services), and its
  behaviour logprobs must agree as the trainer's canary judges it
  (:func:`temper.training.canary.compare`, the job's ``algorithm.mismatch`` tolerance and
  share). A turn sampled by other weights than its label says, or labelled with a version
  the job never published, is a *mislabelled sample*.
- **Rewards**: a sample of scored episodes is scored again here from the submission the
  reward scorer stored with its record (``rewards/<job>/<episode>/t<turn>-a<attempt>.json``)
  by running every reward component in fresh sandboxes; each component must come out the
  same as what the episode was trained with (its value, whether it was measured, its reason),
  ``efficiency`` (a ratio of two measured run times) within ``efficiency_tolerance``.
- **Sessions**: every sandbox turn of the workload prints the digest of the workspace it ran
  in (``tests/faults/workload.py``); it must be the digest of the snapshot the dispatcher
  told the worker to continue from (or of the task's starting files on the first turn), so a
  session whose worker was killed went on from its snapshot with the same bytes.

:func:`check` reads any Temper database and object store (the chaos runs' Postgres and
S3, ``temper run``'s SQLite and directory) and returns a :class:`ContentCheck`.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from services.inference_gateway.checkpoints import fetch_model
from services.reward_scorer.scoring import record_key
from temper import registry
from temper.db import Database, Episode, Job, PolicyVersion, Step
from temper.db.core import SessionTx
from temper.episode_steps import read_steps_of
from temper.events import RewardComponent
from temper.jobspec import JobSpec
from temper.policy import load_causal_lm, token_logprobs
from temper.rewards import Scorer
from temper.rewards.models import load_submission
from temper.settings import DatabaseSettings
from temper.storage import NotFound, ObjectStore
from temper.tasks.service import load_task
from temper.training.canary import Mismatch, compare
from temper.training.lora import peft_quiet
from temper.trajectory import Trajectory
from tests.faults import workload

EFFICIENCY = "efficiency"


@dataclass
class ContentCheck:
    """What the checks found over the jobs they read. ``problems`` says what each failure was."""

    mislabelled: set[tuple[str, int]] = field(default_factory=set)  # (episode, turn)
    disagreements: dict[str, list[str]] = field(default_factory=dict)  # episode -> what differs
    samples_checked: Counter[tuple[str, int]] = field(default_factory=Counter)  # (job, version) -> turns
    tags_checked: int = 0
    logprobs: Mismatch = field(default_factory=Mismatch)  # over every token checked
    rescored: int = 0
    workspace_mismatches: int = 0
    turns_checked: int = 0
    sessions_moved: int = 0  # turns run by another worker process than the turn before, and matched
    problems: list[str] = field(default_factory=list)

    @property
    def mislabelled_samples(self) -> int:
        """Model turns labelled with a version that did not sample them (or that the job lacks)."""
        return len(self.mislabelled)

    @property
    def rescore_disagreements(self) -> int:
        return len(self.disagreements)

    @property
    def ok(self) -> bool:
        return not (self.mislabelled_samples or self.rescore_disagreements or self.workspace_mismatches)

    def add(self, other: ContentCheck) -> None:
        self.mislabelled |= other.mislabelled
        self.disagreements.update(other.disagreements)
        self.samples_checked.update(other.samples_checked)
        self.tags_checked += other.tags_checked
        self.logprobs.add(other.logprobs)
        self.rescored += other.rescored
        self.workspace_mismatches += other.workspace_mismatches
        self.turns_checked += other.turns_checked
        self.sessions_moved += other.sessions_moved
        self.problems += other.problems

    def summary(self) -> str:
        per_version = ", ".join(f"{j[:12]}@v{v}: {n}" for (j, v), n in sorted(self.samples_checked.items()))
        return (
            f"content: {self.mislabelled_samples} mislabelled of {self.tags_checked} tags and "
            f"{sum(self.samples_checked.values())} recomputed turns ({per_version}; max |Δ| "
            f"{self.logprobs.max_abs:.2g} over {self.logprobs.checked} tokens), "
            f"{self.rescore_disagreements} disagreements in {self.rescored} re-scores, "
            f"{self.workspace_mismatches} workspace mismatches in {self.turns_checked} sandbox turns "
            f"({self.sessions_moved} moved to another worker process)"
        )


@dataclass
class _Job:
    row: Job
    spec: JobSpec
    episodes: list[Episode]
    steps: dict[str, list[Step]]
    versions: dict[int, PolicyVersion]


def token_versions(trajectory: Trajectory) -> list[int | None]:
    """The version that sampled each token (None where the model did not: prompt and
    observations). Today a model segment (one turn) carries one version; once trajectories
    record a version per token, this is where it is read."""
    out: list[int | None] = []
    for seg in trajectory.segments:
        version = seg.policy_version if seg.role == "model" else None
        out += [version] * len(seg.token_ids)
    return out


def model_turns(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """(turn, first token, end) of each model segment, in order."""
    out, at, turn = [], 0, 0
    for seg in trajectory.segments:
        if seg.role == "model":
            out.append((turn, at, at + len(seg.token_ids)))
            turn += 1
        at += len(seg.token_ids)
    return out


class Weights:
    """The weights of each (job, version), loaded from the registry into ``cache_dir``."""

    def __init__(self, store: ObjectStore, cache_dir: Path) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self.bases: dict[str, torch.nn.Module] = {}
        self.models: dict[tuple[str, int], torch.nn.Module] = {}

    async def base(self, ref: str) -> torch.nn.Module:
        if ref not in self.bases:
            directory = await fetch_model(self.store, ref, self.cache_dir)
            self.bases[ref] = load_causal_lm(directory)
        return self.bases[ref]

    async def of(self, job: _Job, version: int) -> torch.nn.Module:
        key = (job.row.id, version)
        if key in self.models:
            return self.models[key]
        base_ref = job.spec.policy.init or job.spec.policy.model
        if version == 0:
            model = await self.base(base_ref)
        else:
            row = job.versions[version]
            dest = self.cache_dir / "versions" / uuid.uuid4().hex
            manifest = await registry.fetch_version(self.store, row.checkpoint_key, dest)
            if manifest.kind == "lora":
                from peft import PeftModel

                base = copy.deepcopy(await self.base(base_ref))
                with peft_quiet():
                    model = PeftModel.from_pretrained(base, str(dest)).eval()
            else:
                model = load_causal_lm(dest)
        self.models[key] = model
        return model


async def check(
    db_url: str,
    store: ObjectStore,
    job_ids: Sequence[str],
    *,
    rescore: int = 6,
    efficiency_tolerance: float = workload.EFFICIENCY_TOLERANCE,
    seed: int = 0,
) -> ContentCheck:
    """Every check over the jobs ``job_ids``; ``rescore`` scored episodes of each job are
    scored again (every one when there are fewer)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per model loaded: noise here
    db = Database(DatabaseSettings(url=db_url))
    cache = Path(tempfile.mkdtemp(prefix="temper-content-"))
    result = ContentCheck()
    try:
        jobs = [await _load(db, store, job_id) for job_id in job_ids]
        weights = Weights(store, cache)
        for job in jobs:
            result.add(await _versions_and_logprobs(job, store, weights))
            result.add(_sessions(job, await _snapshots(store, job)))
        result.add(await _rescore(db, store, jobs, rescore, efficiency_tolerance, seed, cache))
    finally:
        await db.dispose()
        shutil.rmtree(cache, ignore_errors=True)
    return result


async def _load(db: Database, store: ObjectStore, job_id: str) -> _Job:
    async with db.session() as s:
        row = await s.get(Job, job_id)
        assert row is not None, f"no job {job_id}"
        episodes = list((await s.execute(select(Episode).where(Episode.job_id == job_id))).scalars())
        versions = {
            v.version: v
            for v in (await s.execute(select(PolicyVersion).where(PolicyVersion.job_id == job_id))).scalars()
        }
        steps = await read_steps_of(await SessionTx.of(s), store, episodes)
    return _Job(row, JobSpec.model_validate(row.spec), episodes, steps, versions)


async def _versions_and_logprobs(job: _Job, store: ObjectStore, weights: Weights) -> ContentCheck:
    out = ContentCheck()
    bad: set[tuple[str, int]] = set()  # (episode, turn)
    job_id = job.row.id
    manifests_ok: dict[int, bool] = {0: True}
    for version, row in job.versions.items():
        try:
            manifest = await registry.read_manifest(store, row.checkpoint_key)
            manifests_ok[version] = manifest.job_id == job_id and manifest.version == version
        except (NotFound, registry.CorruptVersion) as exc:
            out.problems.append(f"job {job_id} v{version}: its manifest cannot be read ({exc})")
            manifests_ok[version] = False
        if not manifests_ok[version]:
            out.problems.append(f"job {job_id} v{version}: the registry's manifest is not this job's version")
    # the tags: every inference result the dispatcher took
    for ep in job.episodes:
        for step in job.steps.get(ep.id, []):
            if step.kind != "inference" or step.state != "done" or not step.result:
                continue
            out.tags_checked += 1
            version = int(step.result.get("policy_version", 0))
            if not manifests_ok.get(version, False):
                bad.add((ep.id, step.turn))
                out.problems.append(
                    f"job {job_id} episode {ep.id[:8]} turn {step.turn}: tagged v{version}, "
                    f"which the registry does not hold for this job (it holds {sorted(manifests_ok)})"
                )
    # the logprobs: every model turn of every stored trajectory, under its label's weights
    tolerance = job.spec.algorithm.mismatch.tolerance
    max_share = job.spec.algorithm.mismatch.max_share
    for ep in job.episodes:
        if not ep.trajectory_key:
            continue
        trajectory = Trajectory.model_validate_json(await store.get(ep.trajectory_key))
        ids, mask, behaviour = trajectory.flat()
        versions = token_versions(trajectory)
        for version in sorted({v for v in versions if v is not None}):
            turns = [
                (turn, start, end)
                for turn, start, end in model_turns(trajectory)
                if any(versions[i] == version for i in range(start, end))
            ]
            if not manifests_ok.get(version, False):
                bad.update((ep.id, turn) for turn, _, _ in turns)
                continue
            recomputed = await _recompute(weights, job, version, ids, mask)
            for turn, start, end in turns:
                own = torch.tensor([versions[i] == version for i in range(start, end)])
                m = compare(
                    recomputed[start:end].unsqueeze(0),
                    torch.tensor([behaviour[start:end]]),
                    own.unsqueeze(0),
                    torch.ones(1),
                    tolerance=tolerance,
                )
                out.logprobs.add(m)
                out.samples_checked[(job_id, version)] += 1
                if m.checked == 0 or m.failed(max_share):
                    bad.add((ep.id, turn))
                    out.problems.append(
                        f"job {job_id} episode {ep.id[:8]} turn {turn} labelled v{version}: "
                        f"{m.over} of {m.checked} tokens past {tolerance:g} (max |Δ| {m.max_abs:.3g}): "
                        "sampled by other weights than its version's"
                    )
    out.mislabelled = bad
    return out


async def _recompute(
    weights: Weights, job: _Job, version: int, ids: list[int], mask: list[int]
) -> torch.Tensor:
    """Each token's logprob under ``version``'s weights (``[T]``)."""
    model = await weights.of(job, version)
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([ids]), completion_mask=torch.tensor([mask]))[0]


async def version_gaps(
    db_url: str, store: ObjectStore, job_id: str, turns: dict[tuple[str, int], tuple[int, int]]
) -> dict[tuple[str, int], torch.Tensor]:
    """For each (episode, turn) -> (version a, version b) of a stored trajectory, |Δ| between
    the turn's token logprobs under a's weights and under b's: how far apart the two labels
    are on what was sampled (near 0 where a step changed nothing those tokens depend on,
    and no logprob check can tell the two apart)."""
    db = Database(DatabaseSettings(url=db_url))
    cache = Path(tempfile.mkdtemp(prefix="temper-content-"))
    out: dict[tuple[str, int], torch.Tensor] = {}
    try:
        job = await _load(db, store, job_id)
        weights = Weights(store, cache)
        for ep in job.episodes:
            wanted = {turn: pair for (episode, turn), pair in turns.items() if episode == ep.id}
            if not wanted or not ep.trajectory_key:
                continue
            trajectory = Trajectory.model_validate_json(await store.get(ep.trajectory_key))
            ids, mask, _ = trajectory.flat()
            labels = {v for pair in wanted.values() for v in pair}
            under = {v: await _recompute(weights, job, v, ids, mask) for v in labels}
            for turn, start, end in model_turns(trajectory):
                if turn in wanted:
                    a, b = wanted[turn]
                    out[(ep.id, turn)] = (under[a][start:end] - under[b][start:end]).abs()
    finally:
        await db.dispose()
        shutil.rmtree(cache, ignore_errors=True)
    return out


async def _snapshots(store: ObjectStore, job: _Job) -> dict[str, dict[str, bytes]]:
    """The files of every snapshot a sandbox turn of the job was told to continue from."""
    out: dict[str, dict[str, bytes]] = {}
    for steps in job.steps.values():
        for step in steps:
            key = (step.request or {}).get("snapshot_key") if step.kind == "sandbox" else None
            if key and key not in out:
                try:
                    out[key] = workload.snapshot_files(await store.get(key))
                except NotFound:
                    out[key] = {}
    return out


def _sessions(job: _Job, snapshots: dict[str, dict[str, bytes]]) -> ContentCheck:
    out = ContentCheck()
    for ep in job.episodes:
        worker = None
        for step in job.steps.get(ep.id, []):
            if step.kind != "sandbox" or step.state != "done" or not step.result:
                continue
            printed = workload.printed_digest(((step.result.get("exec") or {}).get("stdout")) or "")
            if printed is None:
                continue  # the turn ran something else than step.py
            request = step.request or {}
            key = request.get("snapshot_key")
            if key:
                files = snapshots.get(key) or {}
                source = f"snapshot {key}"
            else:
                files = {p: str(c).encode() for p, c in (request.get("files") or {}).items()}
                source = "the task's starting files"
            out.turns_checked += 1
            expected = workload.workspace_digest(files) if files else None
            if printed != expected:
                out.workspace_mismatches += 1
                out.problems.append(
                    f"job {job.row.id} episode {ep.id[:8]} turn {step.turn}: the action ran in workspace "
                    f"{printed}, not {expected} ({source})"
                )
            elif worker is not None and step.result.get("worker") != worker:
                out.sessions_moved += 1
            worker = step.result.get("worker")
    return out


def _components_differ(
    stored: dict[str, Any], fresh: dict[str, RewardComponent], efficiency_tolerance: float
) -> list[str]:
    """What differs between the components an episode was trained with and a re-score."""
    diffs = []
    for name in sorted(set(stored) | set(fresh)):
        if name not in stored or name not in fresh:
            diffs.append(f"{name}: {'only in the re-score' if name not in stored else 'not in the re-score'}")
            continue
        was = RewardComponent.model_validate(stored[name])
        now = fresh[name]
        if was.ok != now.ok:
            diffs.append(f"{name}: measured {was.ok} then {now.ok} ({was.reason!r} / {now.reason!r})")
        elif name == EFFICIENCY:
            if was.value is not None and now.value is not None:
                if abs(was.value - now.value) > efficiency_tolerance:
                    diffs.append(f"{name}: {was.value} then {now.value} (tolerance {efficiency_tolerance})")
            elif was.value != now.value:
                diffs.append(f"{name}: {was.value} then {now.value}")
        elif (was.value, was.reason) != (now.value, now.reason):
            diffs.append(f"{name}: {was.value} ({was.reason!r}) then {now.value} ({now.reason!r})")
    return diffs


async def _rescore(
    db: Database,
    store: ObjectStore,
    jobs: Iterable[_Job],
    per_job: int,
    efficiency_tolerance: float,
    seed: int,
    cache: Path,
) -> ContentCheck:
    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager, SandboxSettings

    out = ContentCheck()
    # under /tmp (mode 1777): the sandbox's own uid must reach its workspace root
    root = Path("/tmp") / f"temper-rescore-{uuid.uuid4().hex[:8]}"
    manager = SandboxManager(scoring_sandbox_settings(SandboxSettings(pool_size=1, workspace_root=root)))
    await manager.start()
    try:
        scorer = Scorer(manager)
        for job in jobs:
            scored = [ep for ep in job.episodes if ep.trajectory_key]
            sample = random.Random(f"{seed}:{job.row.id}").sample(scored, min(per_job, len(scored)))
            for ep in sorted(sample, key=lambda e: e.id):
                out.rescored += 1
                diffs = await _rescore_one(db, store, scorer, job, ep, efficiency_tolerance)
                if diffs:
                    out.disagreements[ep.id] = diffs
                    out.problems.append(
                        f"job {job.row.id} episode {ep.id[:8]} re-scored: " + "; ".join(diffs)
                    )
    finally:
        await manager.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


async def _rescore_one(
    db: Database, store: ObjectStore, scorer: Scorer, job: _Job, ep: Episode, efficiency_tolerance: float
) -> list[str]:
    """The differences between the episode's recorded components and a fresh score of the
    submission its reward record holds."""
    reward_steps = [s for s in job.steps.get(ep.id, []) if s.kind == "reward" and s.state == "done"]
    if len(reward_steps) != 1:
        return [f"{len(reward_steps)} finished reward steps"]
    step = reward_steps[0]
    key = record_key(job.row.id, ep.id, step.turn, step.attempt, "")
    try:
        record = json.loads(await store.get(key))
    except NotFound:
        return [f"no record of the score at {key}"]
    request = record["request"]
    if (request.get("episode_id"), request.get("task_id")) != (ep.id, ep.task_id):
        return [
            f"the record at {key} is of episode {request.get('episode_id')} task {request.get('task_id')}"
        ]
    stored_result = record["result"]["components"]
    diffs = []
    if stored_result != (step.result or {}).get("components"):
        diffs.append("the scorer's record is not the result the episode was trained with")
    async with db.session() as s:
        task = await load_task(s, ep.task_id)
    submission = await load_submission(request["submission"], store)
    _, fresh = await scorer.score(
        task,
        submission,
        request.get("weights") or None,
        turns_used=request.get("turns_used", 1),
        max_turns=request.get("max_turns", 1),
        format_ok=request.get("format_ok", True),
    )
    return diffs + _components_differ(ep.rewards, fresh, efficiency_tolerance)
