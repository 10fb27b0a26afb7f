"""A reward_model job in the trainer component, and what it publishes scoring as the
``reward_model`` reward component.

The preference is synthetic and learnable: the user asks for a word, the chosen reply is
that word, the rejected reply another one of the words. The model sees 160 of the 240
(asked, other) combinations and is judged on the 80 it never saw, through the reward
component (the published version fetched from object storage, the transcript rendered
with the version's own template, batched forwards, the cache)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest
from sqlalchemy import select

from temper.db import OutboxRow, PolicyVersion
from temper.db.migrate import upgrade
from temper.events import Topics
from temper.provenance import directory_files, tree_digest
from temper.registry import fetch_version, prefix_of
from temper.rewards import ScoreContext
from temper.rewards.graders import Graders
from temper.rewards.reward_model import RewardModel
from temper.rewards.transcript import build
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings
from temper.tasks.models import TaskSpec, parse_tasks
from temper.tasks.service import create_taskset
from temper.training.reward_model import is_reward_model
from tests.services.trainer.factory import TENANT, add_job, wait_for
from tests.services.trainer.test_trainer_service import start, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon",
         "piano", "koala", "mango", "otter", "sugar", "flame", "grape", "zebra"]  # fmt: skip


def combinations() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    pairs = [(a, b) for a in WORDS for b in WORDS if a != b]
    random.Random(0).shuffle(pairs)
    return pairs[:160], pairs[160:]


def preference_lines(pairs: list[tuple[str, str]]) -> str:
    """TRL's implicit-prompt form: two whole conversations sharing their first message."""
    lines = []
    for asked, other in pairs:
        prompt = {"role": "user", "content": f"Say {asked}."}
        lines.append(
            {
                "chosen": [prompt, {"role": "assistant", "content": asked}],
                "rejected": [prompt, {"role": "assistant", "content": other}],
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines)


@pytest.fixture
async def settings(tmp_path) -> Settings:
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    return Settings(
        db=DatabaseSettings(url=url),
        storage=StorageSettings(root=tmp_path / "objects"),
        log=LogSettings(level="WARNING"),
    )


SPEC = {
    "name": "rm-test",
    "policy": {"model": "temper-policy"},
    "tasks": {"taskset": "ts-prefs"},
    # 160 pairs in batches of 8: 20 steps an epoch; a version every epoch
    "algorithm": {"name": "reward_model", "learning_rate": 1e-3, "batch_size": 8, "checkpoint_every": 20},
    "schedule": {"iterations": 14},
}
STEPS = 20 * 14


async def rows(runtime, job_id: str) -> list[PolicyVersion]:
    async with runtime.db.session() as s:
        return list(
            await s.scalars(
                select(PolicyVersion).where(PolicyVersion.job_id == job_id).order_by(PolicyVersion.version)
            )
        )


async def test_a_reward_model_job_learns_a_preference_that_then_scores_held_out_transcripts(
    settings, tmp_path
):
    train, held_out = combinations()
    tasks = parse_tasks(preference_lines(train), filename="prefs.jsonl")
    # stored split: the shared first message is the prompt, the replies the two continuations
    assert tasks[0].kind == "preference" and [m.content for m in tasks[0].messages or []] == [
        f"Say {train[0][0]}."
    ]
    assert [m.content for m in tasks[0].chosen or []] == [train[0][0]]
    runtime, component = await start(settings)
    try:
        await add_job(runtime.db, "job-rm", SPEC)
        async with runtime.db.session() as s:
            await create_taskset(s, runtime.store, TENANT, "prefs", tasks, taskset_id="ts-prefs")

        async def done() -> bool:
            versions = await rows(runtime, "job-rm")
            return bool(versions) and versions[-1].step >= STEPS

        await wait_for(done, within=240, what="the reward model's last version")
        versions = await rows(runtime, "job-rm")
        async with runtime.db.session() as s:
            updates = await s.scalar(
                select(OutboxRow.id).where(OutboxRow.topic == Topics.POLICY_UPDATES).limit(1)
            )
    finally:
        await stop(runtime, component)
    assert [(v.version, v.step) for v in versions] == [(n, 20 * n) for n in range(1, 15)]
    assert updates is None  # nothing serves a reward model: no policy.updates
    first = versions[0].metrics
    # the score head starts at zero: every pair at log 2 on the first step
    assert first["loss"] < math.log(2) + 0.05
    # a version's figures are its last batch's (8 pairs): noisy, so the last four together
    curve = [(v.step, round(v.metrics["loss"], 3), v.metrics["pair_accuracy"]) for v in versions]
    late = [v.metrics for v in versions[-4:]]
    late_loss = sum(m["loss"] for m in late) / len(late)
    late_accuracy = sum(m["pair_accuracy"] for m in late) / len(late)
    assert late_loss < 0.45 and late_accuracy > first["pair_accuracy"] + 0.3, curve

    # the published version is a reward model directory that loads on its own
    key = versions[-1].checkpoint_key
    fetched = tmp_path / "fetched"
    await fetch_version(runtime.store, key, fetched)
    assert is_reward_model(fetched)

    component_ = RewardModel()
    graders = Graders(store=runtime.store, cache_dir=tmp_path / "graders", max_batch=16)
    settings_ = {"reward_model": {"model": prefix_of(key)}}
    task = TaskSpec(id="t", kind="math", prompt="(unused)", answer="0")

    async def score(asked: str, reply: str) -> tuple[float, dict]:
        transcript = build(f"Say {asked}.", [(reply, "")])

        async def load():
            return transcript

        ctx = ScoreContext(
            task=task, submission=None, runner=None, settings=settings_, load_transcript=load, graders=graders
        )  # type: ignore[arg-type]
        out = await component_.compute(ctx)
        assert out.ok, out.reason
        return out.value, out.details

    chosen = await asyncio.gather(*(score(a, a) for a, _ in held_out))
    rejected = await asyncio.gather(*(score(a, b) for a, b in held_out))
    right = sum(c[0] > r[0] for c, r in zip(chosen, rejected, strict=True))
    accuracy = right / len(held_out)
    assert accuracy >= 0.8, accuracy
    loaded = next(iter(component_._models.values()))
    # 80 concurrent transcripts took a few batched forwards, not 80
    assert loaded.forwards <= 2 * math.ceil(80 / 16) + 2, loaded.forwards
    # the digest is the version's files', the same as the fetched directory's
    assert chosen[0][1]["model_sha256"] == tree_digest(directory_files(fetched))
    # a transcript scored again is served from the cache, with the same value (the held-out
    # pairs repeat transcripts, so earlier hits depend on timing: count this one only)
    hits = component_.cache_hits
    again = await score(held_out[0][0], held_out[0][0])
    assert again[0] == chosen[0][0] and again[1]["cached"] is True and component_.cache_hits == hits + 1
