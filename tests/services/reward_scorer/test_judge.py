"""The ``judge`` reward component through the real path: the reward scorer component asks
on ``inference.requests`` with ``reply_to: judge.results``, the gateway component runs the
judge model on a CPU engine (in-process bus, SQLite), and the verdict comes back to the
one question waiting for it.

The judge is a tiny model trained here to answer every rubric with ``Score: 7``; another
backend serves a random tiny model, whose babble is an unparsable verdict."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.inference_gateway.component import Gateway
from services.reward_scorer.component import RewardScorer
from temper.db.migrate import upgrade
from temper.events import Topics
from temper.policy import byte_tokenizer, create_model, save_checkpoint
from temper.provenance import directory_files, tree_digest
from temper.rewards.judge import render_rubric
from temper.rewards.transcript import build
from temper.runtime import Runtime
from temper.settings import (
    BusKind,
    BusSettings,
    DatabaseSettings,
    LogSettings,
    Settings,
    StorageKind,
    StorageSettings,
)
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings
from temper.tasks.models import TaskSpec
from temper.training.sft import warm_start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
RUBRIC = "Grade the assistant.\n{transcript}\nEnd with Score: N."
TASK = TaskSpec(id="polite", kind="math", prompt="Say hi politely.", answer="hi")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    """A tiny model that answers any rubric of this shape with 'Score: 7'."""
    import torch

    torch.set_num_threads(1)
    tok = byte_tokenizer()
    model = create_model("tiny", seed=1)
    replies = ["hi", "hi, please", "hello there", "no", "hi!", "whatever", "please, hi", "bye"]
    pairs = [
        ([{"role": "user", "content": render_rubric(RUBRIC, transcript=build("Say hi politely.", [(r, "")]).as_text(),
                                                    task="", reply=r)}], "Score: 7")
        for r in replies
    ]  # fmt: skip
    warm_start(model, tok, pairs, steps=120, batch_size=8, learning_rate=3e-3, seed=0)
    d = tmp_path_factory.mktemp("judge") / "judge-model"
    save_checkpoint(model, d, tokenizer=tok)
    return d


def settings(tmp: Path, judge_dir: Path) -> Settings:
    return Settings(
        bus=BusSettings(kind=BusKind.inprocess, retry_backoff_s=0.01),
        db=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp}/temper.db"),
        storage=StorageSettings(kind=StorageKind.local, root=tmp / "objects"),
        data_dir=tmp,
        log=LogSettings(level="WARNING"),
        inference=InferenceSettings(
            checkpoint_cache_dir=str(tmp / "cache"),
            retry_backoff_s=0.001,
            request_timeout_s=30,
            backends=[
                BackendSpec(name="judge-0", kind=BackendKind.local, model_dir=str(judge_dir)),
                BackendSpec(name="random-0", kind=BackendKind.local, pool="random"),  # the tiny preset
            ],
        ),
    )


NO_SANDBOX = SimpleNamespace(settings=SimpleNamespace(python="python3"), backend=object())  # math runs none


async def test_a_judge_grades_through_the_gateway_and_its_verdicts_are_recorded(tmp_path, judge_dir):
    s = settings(tmp_path, judge_dir)
    await asyncio.to_thread(upgrade, s.db.url)
    rt = Runtime(s, service="judge-test")
    await rt.start()
    gateway, scorer = Gateway(rt), RewardScorer(rt, manager=NO_SANDBOX)  # type: ignore[arg-type]
    await gateway.start()
    await scorer.start()
    on_inference_results: list[object] = []

    async def collect(record) -> None:  # noqa: ANN001
        on_inference_results.append(record)

    await rt.bus.subscribe([Topics.INFERENCE_RESULTS], "test-results", collect)
    try:
        sc = scorer.scoring.scorer

        async def judged(settings: dict, reply: str = "hi, please", **kw):
            async def transcript():
                return build(TASK.prompt, [(reply, "")])

            weights = {"answer_match": 1.0, "judge": 0.5}
            return await sc.score(
                TASK, {"answer": "hi"}, weights, settings={"judge": settings}, transcript=transcript, **kw
            )

        judge = {"model": str(judge_dir), "prompt": RUBRIC, "max_tokens": 12}
        reward, comps = await judged(judge)
        j = comps["judge"]
        assert j.ok and j.value == 0.7 and reward == pytest.approx(1.0 + 0.5 * 0.7), j
        d = j.details
        assert d["verdict"].strip() == "Score: 7" and d["score"] == 7.0 and d["attempts"] == 1
        # what makes a re-score reproducible: the rubric, the prompt's hash, the model and its digest
        assert d["prompt"] == RUBRIC and d["model"] == str(judge_dir)
        assert d["model_sha256"] == tree_digest(directory_files(judge_dir))
        assert d["served_version"] == 0 and d["backend"] == "judge-0" and d["sampling"]["temperature"] == 0.0
        asked = sc.component("judge").asked  # type: ignore[attr-defined]
        # the same transcript again: from the cache, nothing asked; another transcript: asked
        _, again = await judged(judge)
        assert again["judge"].details["cached"] is True and sc.component("judge").asked == asked  # type: ignore[attr-defined]
        _, other = await judged(judge, reply="no")
        assert (
            other["judge"].value == 0.7
            and other["judge"].details["transcript_sha256"] != d["transcript_sha256"]
        )
        # a re-score with a fresh scorer (no cache) gets the same verdict from the same prompt
        sc.components.pop("judge")
        _, fresh = await judged(judge)
        assert fresh["judge"].details["verdict"] == d["verdict"] and "cached" not in fresh["judge"].details

        # a random model's babble: recorded, not guessed, not rewarded
        babble = {**judge, "model": "tiny", "pool": "random", "max_tokens": 8, "temperature": 1.0, "seed": 3}
        reward, comps = await judged(babble)
        j = comps["judge"]
        assert not j.ok and j.value is None and j.reason.startswith("unparsable verdict: "), j
        assert "verdict" in j.details and "score" not in j.details and j.details["backend"] == "random-0"
        assert reward == 1.0  # answer_match alone: the judge's weight adds nothing

        # nothing serves pool 'nowhere': each question times out, is asked again, then given up
        # (a transcript not asked before: the cache answers by model and prompt, wherever served)
        reward, comps = await judged(
            {**judge, "pool": "nowhere", "timeout_s": 0.3, "retries": 1}, reply="wait"
        )
        j = comps["judge"]
        assert not j.ok and j.reason == (
            "the judge did not answer: attempt 1: no answer in 0.3s; attempt 2: no answer in 0.3s"
        )
        assert j.details["attempts"] == 2 and reward == 1.0

        # model: policy asks the job's own policy (here: the same directory, at its version 0)
        _, comps = await judged(
            {**judge, "model": "policy"}, job_id="job-p", policy={"model": str(judge_dir)}
        )
        assert comps["judge"].value == 0.7 and comps["judge"].details["served_version"] == 0
        # the answers reached this replica's own group on judge.results, none were lost
        assert scorer.judges is not None and scorer.judges.answered >= 5
        assert on_inference_results == []  # the dispatcher's topic never saw a judge's answer
    finally:
        await scorer.stop()
        await gateway.stop()
        await rt.stop()
