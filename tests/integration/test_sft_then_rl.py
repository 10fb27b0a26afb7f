"""RL, then filtered SFT on its best episodes, then RL from the SFT job's version: three
jobs on one real stack (the five services as processes, real Kafka, Postgres and S3, as
tests/integration/test_distributed_job.py runs them, through the launcher's ``running``).

1. a short RL job on the warm-started tiny policy completes;
2. an sft job with ``tasks.from_job`` (each task's best episode) trains on conversations
   that are exactly those episodes' (their replies read back from the stored
   trajectories) and publishes versions;
3. an RL job whose ``policy.init`` is ``job:<sft handle>@latest`` is pinned to the sft
   job's last version and its first episodes were sampled from those weights: their
   behaviour logprobs are the sft version's forward pass, not the base policy's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import yaml
from sqlalchemy import select

from services.dispatcher.api.transcripts import load_trajectory
from services.launcher import processes as stack
from temper import registry
from temper.db import Database, Episode, Task
from temper.policy.model import load_causal_lm, token_logprobs
from temper.settings import DatabaseSettings
from temper.storage import S3Store
from temper.trajectory import Trajectory
from tests.integration.test_distributed_job import small_spec

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.postgres,
    pytest.mark.s3,
    pytest.mark.slow,
    pytest.mark.timeout(480),
]

SFT_HANDLE = "best-of-rl"
SFT_EPOCHS = 3


def spec_file(tmp_path: Path) -> Path:
    """The small example job, smaller: 2 iterations of 2 groups of 4, a 100-step warm start."""
    path = small_spec(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["schedule"].update(iterations=2)
    doc["local"]["warm_start"].update(examples=2000, steps=100)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def episodes_of(url: str, store: S3Store, job_id: str) -> list[tuple[Episode, Task, Trajectory | None]]:
    db = Database(DatabaseSettings(url=url))
    try:
        async with db.session() as s:
            rows = (
                await s.execute(
                    select(Episode, Task)
                    .join(Task, Task.id == Episode.task_id)
                    .where(Episode.job_id == job_id)
                )
            ).all()
    finally:
        await db.dispose()
    return [(ep, task, await load_trajectory(store, ep.trajectory_key or "")) for ep, task in rows]


async def tasks_of(url: str, taskset_id: str) -> list[Task]:
    db = Database(DatabaseSettings(url=url))
    try:
        async with db.session() as s:
            return list((await s.execute(select(Task).where(Task.task_set_id == taskset_id))).scalars())
    finally:
        await db.dispose()


def test_an_sft_job_on_an_rl_jobs_best_episodes_starts_the_next_rl_job(
    tmp_path, kafka_bootstrap, postgres_database_url, s3_settings
):
    args = stack.build_parser().parse_args(
        [
            str(spec_file(tmp_path)),
            "--database-url", postgres_database_url,
            "--runs-dir", str(tmp_path / "runs"),
            "--free-ports",
            "--trainer-threads", "1",
            "--health-timeout", "240",
        ]
    )  # fmt: skip
    store = S3Store(s3_settings)
    with stack.running(args) as run:
        api, base = run.api, run.spec.model_dump(mode="json", exclude_none=True)
        logs = lambda: {p.name: p.read_text(errors="replace")[-2000:] for p in run.run_dir.glob("*.log")}  # noqa: E731

        # 1. the RL job
        rl_id = api.submit(base)["id"]
        assert stack.follow(run, rl_id, timeout_s=240) == "completed", logs()

        # 2. filtered SFT on its episodes: each task's best (reward, then id)
        sft_spec = {
            "name": "filtered-sft",
            "handle": SFT_HANDLE,
            "policy": {"model": base["policy"]["model"], "init": base["policy"]["init"]},
            "tasks": {"from_job": rl_id, "best_of": 1},
            "algorithm": {"name": "sft", "learning_rate": 0.003, "batch_size": 4, "checkpoint_every": 1},
            "schedule": {"iterations": SFT_EPOCHS},
        }
        sft = api.submit(sft_spec)
        sft_id, made = sft["id"], sft["spec"]["tasks"]["taskset"]
        assert stack.follow(run, sft_id, timeout_s=120) == "completed", logs()
        versions = api._call("GET", f"/v1/jobs/{sft_id}/checkpoints")

        # 3. RL from the sft job's latest version
        rl2_spec = {
            **base,
            "name": "rl-from-sft",
            "policy": {**base["policy"], "init": f"job:{SFT_HANDLE}@latest"},
        }
        rl2_spec["schedule"] = {**base["schedule"], "iterations": 1}
        rl2 = api.submit(rl2_spec)
        rl2_id, pinned = rl2["id"], rl2["spec"]["policy"]["init"]
        assert stack.follow(run, rl2_id, timeout_s=240) == "completed", logs()

    data = {t.key: t for t in asyncio.run(tasks_of(postgres_database_url, made))}
    rl_episodes = asyncio.run(episodes_of(postgres_database_url, store, rl_id))
    scored = [(ep, task, traj) for ep, task, traj in rl_episodes if ep.state in ("scored", "trained")]
    assert len(scored) == len(rl_episodes) == 2 * 2 * 4
    best: dict[str, tuple[Episode, Task, Trajectory | None]] = {}
    for ep, task, traj in sorted(scored, key=lambda x: (-(x[0].reward or 0.0), x[0].id)):
        best.setdefault(task.id, (ep, task, traj))
    # the sft data is exactly each task's best episode, as the policy wrote it
    assert sorted(data) == sorted(f"{task.key}/{ep.id}" for ep, task, _ in best.values())
    for ep, task, traj in best.values():
        assert traj is not None and traj.reward == ep.reward
        row = data[f"{task.key}/{ep.id}"]
        assert row.kind == "chat" and row.meta["reward"] == ep.reward
        messages = row.spec["messages"]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert replies == [turn.action_text for turn in traj.turns], (replies, traj.turns)
        # the environment's opening (the task, its workspace files), then the reply
        assert [m["role"] for m in messages][-2:] == ["user", "assistant"], messages
        assert messages[-2]["content"].startswith(task.prompt), messages[-2]

    # the sft job stepped ceil(n / 4) times an epoch and published a version per step
    steps = SFT_EPOCHS * -(-len(best) // 4)
    assert [(v["version"], v["step"]) for v in versions] == [(n, n) for n in range(1, steps + 1)], versions
    assert pinned == registry.version_prefix("default", sft_id, steps), pinned

    # the next RL job's first episodes were sampled from the sft weights, not the base's
    sft_dir, base_dir = tmp_path / "sft-version", Path(base["policy"]["model"])
    asyncio.run(registry.fetch_version(store, registry.manifest_key(pinned), sft_dir))
    models = {"sft": load_causal_lm(sft_dir), "base": load_causal_lm(base_dir)}
    first = [traj for ep, _, traj in asyncio.run(episodes_of(postgres_database_url, store, rl2_id))]
    first = [t for t in first if t is not None and t.behaviour_version == 0]
    assert len(first) >= 4, len(first)
    for traj in first:
        ids, own, behaviour = traj.flat()
        got = torch.tensor(behaviour)[torch.tensor(own)]
        with torch.no_grad():
            want = {
                name: token_logprobs(m, torch.tensor([ids]))[0][torch.tensor(own)]
                for name, m in models.items()
            }
        assert torch.allclose(got, want["sft"], atol=1e-3), (got - want["sft"]).abs().max()
        assert not torch.allclose(got, want["base"], atol=1e-2), traj.episode_id
