"""The chaos runs' content checks (content.py) catch what counting rows cannot. One job of
the chaos workload runs (``temper run``, one process) with two planted faults: a gateway
that tags every result sampled by version v >= 1 as v - 1 (a version the job has, so only
the logprobs can tell), and a reward scorer that drops the ``compiles`` component (it has
no weight, so the rewards stay the same). The job completes all the same; the checks name
exactly the turns the gateway mislabelled and every re-scored episode, for that component
only, and find every sandbox turn in the workspace it should have run in."""

from __future__ import annotations

import asyncio
import io
import sqlite3
from pathlib import Path

import pytest
import yaml

from services.embedded import runner
from services.inference_gateway.inference import Inference
from services.reward_scorer.scoring import SubmissionScorer
from temper.events import InferenceRequest, InferenceResult, RewardRequest, RewardResult
from temper.storage import LocalStore
from tests.faults import content, workload
from tests.faults.harness import CACHE_DIR

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]


@pytest.mark.timeout(300)
def test_a_mislabelling_gateway_and_a_scorer_dropping_a_component_are_caught(tmp_path: Path, monkeypatch):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(workload.taskset_bytes())
    spec = workload.spec("planted-faults", iterations=3, episodes=8, lora=True)
    spec["policy"]["model"] = str(workload.cached_policy(CACHE_DIR))
    spec["local"] = {"taskset_file": str(tasks)}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    mislabelled: set[tuple[str, int]] = set()
    handle, score = Inference.handle, SubmissionScorer.score

    async def mislabelling(self: Inference, request: InferenceRequest) -> InferenceResult:
        result = await handle(self, request)
        if result.error is None and result.policy_version >= 1:
            mislabelled.add((str(result.episode_id), int(result.turn or 0)))
            return result.model_copy(update={"policy_version": result.policy_version - 1})
        return result

    async def dropping(self: SubmissionScorer, request: RewardRequest) -> RewardResult:
        result = await score(self, request)
        kept = {name: c for name, c in result.components.items() if name != "compiles"}
        return result.model_copy(update={"components": kept})

    monkeypatch.setattr(Inference, "handle", mislabelling)
    monkeypatch.setattr(SubmissionScorer, "score", dropping)
    run = asyncio.run(runner.run(tmp_path / "spec.yaml", runs_dir=tmp_path / "runs", out=io.StringIO()))
    assert run.state == "completed"
    check = asyncio.run(
        content.check(
            f"sqlite+aiosqlite:///{run.run_dir / 'temper.db'}",
            LocalStore(run.run_dir / "objects"),
            [run.job_id],
            rescore=4,
        )
    )
    print(f"\n{check.summary()}")  # noqa: T201 - what the checks saw
    # the gateway's fault: exactly the turns it mislabelled, each by its logprobs, of the
    # episodes whose trajectory was stored (what the checks read; a fresh-clone run under load
    # had one mislabelled result in an episode that stored none)
    with sqlite3.connect(run.run_dir / "temper.db") as db:
        stored = {row[0] for row in db.execute("SELECT id FROM episodes WHERE trajectory_key IS NOT NULL")}
    mislabelled = {(episode, turn) for episode, turn in mislabelled if episode in stored}
    assert mislabelled, "no result was sampled by a version >= 1: the plant was never reached"
    assert check.mislabelled == mislabelled
    assert not [p for p in check.problems if "registry does not hold" in p]  # v - 1 is a version it has
    # the scorer's fault: every re-scored episode, for the dropped component and nothing else
    assert check.rescored == 4
    assert len(check.disagreements) == 4
    assert all(d == ["compiles: only in the re-score"] for d in check.disagreements.values()), (
        check.disagreements
    )
    assert check.workspace_mismatches == 0 and check.turns_checked > 0
