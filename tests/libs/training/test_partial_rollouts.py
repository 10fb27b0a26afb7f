"""Episodes whose tokens come from two policy versions (partial rollouts): the learner takes
each token's own behaviour logprob, counts staleness per token and checks with the canary
only the tokens its own version sampled. The loss is checked against a reference written
here with numpy, one token at a time, from the per-token logprobs the trajectory carries."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from services.trainer.buffer import Buffered, TrainingJob
from services.trainer.ledger import SKIP_STALE
from temper.jobspec import JobSpec
from temper.policy import create_model, default_tokenizer, encode_chat
from temper.training import Learner, LearnerConfig
from temper.trajectory import NOT_SAMPLED, Segment, Trajectory
from tests.libs.training.batches import plain

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()
REWARDS = [1.0, 0.0, 0.5, 0.25]
CLIP = 0.2


def two_version_group(v0, v1, seed: int = 7) -> list[Trajectory]:
    """Four episodes of two turns: the first turn sampled by version 0 (``v0``'s weights), the
    second begun on version 0 and finished on version 1 (an interrupted generation resumed
    on the new version). Each token's behaviour logprob is the logprob of the weights that
    sampled it."""
    rng = random.Random(seed)
    group = []
    for i, reward in enumerate(REWARDS):
        prompt = encode_chat(TOK, [{"role": "user", "content": f"fix bug {i}"}])
        first = [rng.randrange(97, 123) for _ in range(3 + i)] + [TOK.stop_ids[0]]
        observation = TOK.encode(f" tests: {i} failed ")
        second = [rng.randrange(97, 123) for _ in range(4 + i)] + [TOK.stop_ids[0]]
        cut = 2  # the first two tokens of the second turn were sampled before the new version came
        ids = prompt + first + observation + second
        lp0, _ = plain(v0, ids)
        lp1, _ = plain(v1, ids)
        a, b = len(prompt), len(prompt) + len(first) + len(observation)
        second_versions = [0] * cut + [1] * (len(second) - cut)
        second_logprobs = [
            (lp0 if v == 0 else lp1)[b + k] for k, v in enumerate(second_versions)
        ]  # fmt: skip
        group.append(
            Trajectory(
                job_id="j",
                episode_id=f"e{i}",
                task_id="t",
                group_id="g",
                reward=reward,
                segments=[
                    Segment(role="prompt", token_ids=prompt),
                    Segment(
                        role="model",
                        token_ids=first,
                        logprobs=lp0[a : a + len(first)],
                        token_versions=[0] * len(first),
                        policy_version=0,
                    ),
                    Segment(role="observation", token_ids=observation),
                    Segment(
                        role="model",
                        token_ids=second,
                        logprobs=second_logprobs,
                        token_versions=second_versions,
                        policy_version=1,
                    ),
                ],
            )
        )
    return group


def reference_loss(policy, group: list[Trajectory], eps: float = 1e-4) -> tuple[float, int]:
    """GRPO's clipped loss, token mean over the model's tokens (token 0 of a sequence has no
    context), each token's ratio against its own behaviour logprob: ``pi(token) /
    pi_behaviour(token)``, where the behaviour is whichever version sampled that token."""
    rewards = np.array([t.reward for t in group])
    adv = (rewards - rewards.mean()) / (rewards.std() + eps)
    terms = []
    for traj, a in zip(group, adv, strict=True):
        ids, behaviour, own = [], [], []
        for seg in traj.segments:
            ids += seg.token_ids
            behaviour += seg.logprobs if seg.role == "model" else [0.0] * len(seg.token_ids)
            own += [seg.role == "model"] * len(seg.token_ids)
        cur, _ = plain(policy, ids)
        for t in range(1, len(ids)):
            if not own[t]:
                continue
            ratio = math.exp(cur[t] - behaviour[t])
            terms.append(-min(ratio * a, min(max(ratio, 1 - CLIP), 1 + CLIP) * a))
    return sum(terms) / len(terms), len(terms)


def test_an_episode_of_two_versions_trains_on_each_tokens_own_logprob() -> None:
    v0, v1 = create_model(seed=1), create_model(seed=2)
    group = two_version_group(v0, v1)
    assert all(t.versions_spanned == [0, 1] and t.behaviour_version == 0 for t in group)
    want, tokens = reference_loss(v1, group)
    # the loss a trainer gets that takes one version per trajectory (every token v1's logprob):
    # different, so the check below can tell them apart
    one_version = [t.model_copy(deep=True) for t in group]
    for t in one_version:
        for seg in t.segments[1::2]:
            ids = [x for s in t.segments for x in s.token_ids]
            lp, _ = plain(v1, ids)
            start = sum(len(s.token_ids) for s in t.segments[: t.segments.index(seg)])
            seg.logprobs = lp[start : start + len(seg.token_ids)]
    wrong, _ = reference_loss(v1, one_version)
    assert abs(wrong - want) > 1e-3  # 100x the tolerance of the check below

    learner = Learner(create_model(seed=2), LearnerConfig(clip_eps=CLIP, learning_rate=1e-3), device="cpu")
    learner.version = 1  # its weights are version 1's: the canary runs on this first step
    stats = learner.step([group])
    assert stats.updated and stats.model_tokens == tokens
    assert stats.loss == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert stats.pg_loss == pytest.approx(want, rel=1e-4, abs=1e-6)

    # staleness per token: the version-0 tokens are one version behind, the version-1 ones none
    versions = [v for t in group for v in t.model_versions()]
    assert stats.token_staleness_mean == pytest.approx(sum(1 - v for v in versions) / len(versions))
    assert stats.token_staleness_max == 1 and stats.staleness == [1, 1, 1, 1]
    assert stats.multi_version_samples == 4 and stats.multi_version_share == 1.0

    # the canary checks exactly the tokens version 1 sampled (each logprob the learner's own),
    # not the version-0 tokens beside them in the same rows (which would all be past tolerance)
    v1_tokens = sum(1 for t in group for v in t.model_versions() if v == 1)
    assert stats.canary and stats.mismatch_tokens == v1_tokens
    assert stats.mismatch_max < 1e-4 and not stats.mismatch_failed


def test_a_trajectory_of_schema_1_reads_one_version_per_segment() -> None:
    raw = {
        "schema_version": 1,
        "job_id": "j",
        "episode_id": "e",
        "task_id": "t",
        "group_id": "g",
        "reward": 1.0,
        "segments": [
            {"role": "prompt", "token_ids": [1, 2]},
            {"role": "model", "token_ids": [3, 4], "logprobs": [-1.0, -2.0], "policy_version": 3},
            {"role": "observation", "token_ids": [5]},
            {"role": "model", "token_ids": [6], "logprobs": [-0.5], "policy_version": 4},
        ],
    }
    t = Trajectory.model_validate(raw)
    assert t.model_versions() == [3, 3, 4] and t.behaviour_version == 3 and t.versions_spanned == [3, 4]
    assert t.flat_versions() == [NOT_SAMPLED, NOT_SAMPLED, 3, 3, NOT_SAMPLED, 4]
    with pytest.raises(ValueError, match="token versions"):
        Segment(role="model", token_ids=[1, 2], logprobs=[0.0, 0.0], token_versions=[1])


class _Learner(SimpleNamespace):
    version: int


def _job(max_staleness: int, version: int) -> TrainingJob:
    spec = JobSpec.model_validate(
        {
            "name": "stale",
            "policy": {"model": "tiny"},
            "tasks": {"taskset": "ts", "group_size": 2},
            "schedule": {"max_staleness": max_staleness},
        }
    )
    return TrainingJob("j", "t", spec, _Learner(version=version))  # type: ignore[arg-type]


def _traj(episode: str, group: str, versions: list[int], reward: float) -> Buffered:
    seg = Segment(role="model", token_ids=[1] * len(versions), logprobs=[0.0] * len(versions),
                  token_versions=versions, policy_version=versions[-1])  # fmt: skip
    t = Trajectory(job_id="j", episode_id=episode, task_id="t", group_id=group, reward=reward, segments=[seg])
    return Buffered(t, key=episode, arrived=0.0)


def test_max_staleness_bounds_the_oldest_token_of_a_trajectory() -> None:
    job = _job(max_staleness=2, version=4)
    # group a: its oldest token is version 1, three behind; group b: every token within 2
    job.add(_traj("a1", "a", [1, 4, 4], 1.0))
    job.add(_traj("a2", "a", [3, 4], 0.0))
    job.add(_traj("b1", "b", [2, 3, 4], 1.0))
    job.add(_traj("b2", "b", [4, 4], 0.0))
    dropped = job.sweep(now=0.0, group_timeout_s=60.0)
    assert [(sorted(b.episode_id for b in g), why) for g, why in dropped] == [(["a1", "a2"], SKIP_STALE)]
    assert [[b.episode_id for b in g] for g in job.ready] == [["b1", "b2"]]


def test_a_trajectory_of_two_sequences_keeps_each_tokens_version() -> None:
    """An agent that rewrote its history between two model calls gives two sequences
    (``Trajectory.samples``); each sample carries the versions of its own tokens."""
    from temper.training.batch import samples_from_groups

    def episode(i: int, reward: float) -> Trajectory:
        return Trajectory(
            job_id="j",
            episode_id=f"e{i}",
            task_id="t",
            group_id="g",
            reward=reward,
            segments=[
                Segment(role="prompt", token_ids=[1, 2]),
                Segment(role="model", token_ids=[3, 4], logprobs=[-0.1, -0.2], token_versions=[0, 0]),
                Segment(role="prompt", token_ids=[5]),  # a rewritten history: a second sequence
                Segment(role="model", token_ids=[6, 7, 8], logprobs=[-0.3] * 3, token_versions=[0, 1, 1]),
            ],
        )

    samples, skipped = samples_from_groups([[episode(0, 1.0), episode(1, 0.0)]])
    assert skipped == 0 and len(samples) == 4
    first, second = samples[0], samples[1]
    assert first.ids == [1, 2, 3, 4] and first.versions == [NOT_SAMPLED, NOT_SAMPLED, 0, 0]
    assert second.ids == [5, 6, 7, 8] and second.versions == [NOT_SAMPLED, 0, 1, 1]
    assert second.model_versions() == [0, 1, 1] and second.behaviour_version == 0
