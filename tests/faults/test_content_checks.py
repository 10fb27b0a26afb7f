"""The chaos runs' content checks (content.py) catch what counting rows cannot. One job of
the chaos workload runs (``temper run``, one process) with two planted faults: a gateway
that tags every result sampled by version v >= 1 as v - 1 (a version the job has, so only
the logprobs can tell), and a reward scorer that drops the ``compiles`` component (it has
no weight, so the rewards stay the same). The job completes all the same; the checks name
every mislabelled turn whose two versions' weights tell apart (and no other turn), every
re-scored episode, for that component only, and find every sandbox turn in the workspace it
should have run in."""

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
from temper.jobspec import MismatchSpec
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

    mislabelled: dict[tuple[str, int], int] = {}  # (episode, turn) -> the version that sampled it
    handle, score = Inference.handle, SubmissionScorer.score

    async def mislabelling(self: Inference, request: InferenceRequest) -> InferenceResult:
        result = await handle(self, request)
        if result.error is None and result.policy_version >= 1:
            mislabelled[(str(result.episode_id), int(result.turn or 0))] = result.policy_version
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
    db_url, store = f"sqlite+aiosqlite:///{run.run_dir / 'temper.db'}", LocalStore(run.run_dir / "objects")
    check = asyncio.run(content.check(db_url, store, [run.job_id], rescore=4))
    print(f"\n{check.summary()}")  # noqa: T201 - what the checks saw
    # the gateway's fault, judged turn by turn from the two versions' own weights: a turn whose
    # logprobs under its true version and under the label differ clearly (past twice the
    # tolerance on more than the allowed share of its tokens) must be caught; one where they
    # agree within half the tolerance cannot be (a step that changed nothing those tokens
    # depend on); nothing the gateway labelled truly is caught. Only episodes that stored a
    # trajectory are checked (a fresh-clone run under load had a mislabelled result in an
    # episode that stored none).
    with sqlite3.connect(run.run_dir / "temper.db") as db:
        stored = {row[0] for row in db.execute("SELECT id FROM episodes WHERE trajectory_key IS NOT NULL")}
    planted = {key: (true, true - 1) for key, true in mislabelled.items() if key[0] in stored}
    gaps = asyncio.run(content.version_gaps(db_url, store, run.job_id, planted))
    mismatch = MismatchSpec.model_validate(spec["algorithm"].get("mismatch", {}))

    def apart(gap, tolerance: float) -> bool:
        return float((gap > tolerance).float().mean()) > mismatch.max_share

    clear = {key for key, gap in gaps.items() if apart(gap, 2 * mismatch.tolerance)}
    alike = {key for key, gap in gaps.items() if not apart(gap, mismatch.tolerance / 2)}
    print(f"planted {len(planted)}: {len(clear)} clearly apart, {len(alike)} alike")  # noqa: T201
    assert clear, "no planted turn was sampled by weights its label's differ from: nothing to catch"
    assert check.mislabelled <= set(planted), check.mislabelled - set(planted)
    assert clear <= check.mislabelled, clear - check.mislabelled
    assert not (alike & check.mislabelled), alike & check.mislabelled
    assert not [p for p in check.problems if "registry does not hold" in p]  # v - 1 is a version it has
    # the scorer's fault: every re-scored episode, for the dropped component and nothing else
    assert check.rescored == 4
    assert len(check.disagreements) == 4
    assert all(d == ["compiles: only in the re-score"] for d in check.disagreements.values()), (
        check.disagreements
    )
    assert check.workspace_mismatches == 0 and check.turns_checked > 0
