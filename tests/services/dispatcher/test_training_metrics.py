"""The trainer's own numbers where people look: each version's loss, KL, entropy, grad
norm, clip fraction, learning rate and tokens in the job's metrics (REST, ``temper
metrics``), the groups it skipped by reason, and why a job has not trained."""

from __future__ import annotations

import pytest

from temper.cli.results import training_lines
from temper.db import Database, PolicyVersion, TrainedTrajectory
from temper.training import Learner, LearnerConfig
from tests.libs.training.batches import fixed_batch

pytestmark = pytest.mark.timeout(60)


async def test_each_versions_trainer_numbers_and_the_skipped_groups(client, env, seeded):
    from temper.policy import create_model

    settings, _ = env
    learner = Learner(create_model(seed=1), LearnerConfig(learning_rate=3e-4), device="cpu")
    # the same batch twice: the second step's ratios are the updated model's (a batch made
    # afresh from the updated model would give it the same ratios, so the same loss)
    batch = fixed_batch(learner.model)
    first = learner.step(batch).as_dict()
    second = learner.step(batch).as_dict()
    assert first["entropy"] > 0 and first["loss"] != second["loss"]

    m = (await client.get(f"/v1/jobs/{seeded.job_id}/metrics")).json()["training"]
    assert m["versions"] == [] and m["trained_episodes"] == 0
    assert m["not_trained_reason"] == "waiting for 4 complete groups for the first step", m  # the default

    db = Database(settings.db)
    try:
        async with db.session() as s:
            # the canary's figures as the trainer adds them to the version it checked (v1 only)
            canary = {"tokens": 40, "mean": 0.012, "max": 0.2, "over": 3, "failed_batches": 1}
            for n, stats in ((1, {**first, "logprob_canary": canary}), (2, second)):
                s.add(PolicyVersion(job_id=seeded.job_id, version=n, checkpoint_key=f"k{n}", step=n,
                                    metrics=stats, train_s=0.5 * n))  # fmt: skip
            for i, ep_id in enumerate(seeded.episodes[:6]):  # three groups of two: one trained, two skipped
                skipped = None if i < 2 else ("zero_reward_variance" if i < 4 else "stale")
                s.add(TrainedTrajectory(episode_id=ep_id, job_id=seeded.job_id, trajectory_key="t",
                                        group_id=f"g{i // 2}", step=1 if i < 2 else None, skipped=skipped))  # fmt: skip
    finally:
        await db.dispose()

    m = (await client.get(f"/v1/jobs/{seeded.job_id}/metrics")).json()["training"]
    assert [v["version"] for v in m["versions"]] == [1, 2]
    for v, stats in zip(m["versions"], (first, second), strict=True):
        for key in ("loss", "kl", "entropy", "grad_norm", "clip_fraction", "learning_rate", "tokens",
                    "correction_weight_mean", "correction_capped_fraction"):  # fmt: skip
            assert v[key] == pytest.approx(stats[key]), key
    assert first["correction_weight_mean"] == 1.0  # no correction: every token weighs 1
    one, two = m["versions"]
    assert (one["canary_tokens"], one["canary_mean"], one["canary_max"], one["canary_failed_batches"]) == (
        40, 0.012, 0.2, 1,
    )  # fmt: skip
    assert two["canary_tokens"] is None and two["canary_mean"] is None  # not run on v2: not a pass
    assert m["versions"][0]["learning_rate"] == pytest.approx(3e-4) and m["versions"][1]["train_s"] == 1.0
    assert m["skipped_groups"] == {"zero_reward_variance": 1, "stale": 1}
    assert m["trained_episodes"] == 2 and m["not_trained_reason"] is None

    lines = training_lines(m)
    table = lines[lines.index("\ntraining per version") + 1 :]
    header, row = table[0].split(), table[1].split()
    assert header[:5] == ["version", "step", "loss", "kl", "entropy"]
    assert row[0] == "v1" and float(row[2]) == pytest.approx(first["loss"], abs=1e-4)
    assert float(row[4]) == pytest.approx(first["entropy"], abs=1e-3)
    assert "\ngroups not trained on: stale 1, zero_reward_variance 1" in lines


async def test_a_job_whose_every_group_was_skipped_says_so(client, env, seeded):
    settings, _ = env
    db = Database(settings.db)
    try:
        async with db.session() as s:
            for i, ep_id in enumerate(seeded.episodes[:4]):
                s.add(TrainedTrajectory(episode_id=ep_id, job_id=seeded.job_id, trajectory_key="t",
                                        group_id=f"g{i // 2}", skipped="zero_reward_variance"))  # fmt: skip
    finally:
        await db.dispose()
    m = (await client.get(f"/v1/jobs/{seeded.job_id}/metrics")).json()["training"]
    assert m["not_trained_reason"] == "every group so far was skipped (2 zero_reward_variance)"
    assert "\nnot trained yet: every group so far was skipped (2 zero_reward_variance)" in training_lines(m)
