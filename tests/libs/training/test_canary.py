"""The logprob canary in the learner: tokens sampled by the learner's version, checked on
the first step on that version's weights, against a reference computed here by hand."""

from __future__ import annotations

import pytest
import torch

from temper.jobspec import OnMismatch
from temper.policy import create_model, default_tokenizer, encode_chat
from temper.training import Learner, LearnerConfig
from temper.training.learner import REFUSED_MISMATCH
from temper.trajectory import Segment, Trajectory

pytestmark = pytest.mark.timeout(90)

TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "Is it?"}])
ANSWERS = [("yes", 1.0), ("no", 0.0), ("maybe not", 0.5), ("yes it is", 1.0)]


def group(
    learner: Learner, *, version: int | None = None, shift: list[float] | None = None
) -> list[Trajectory]:
    """One group whose behaviour logprobs are the learner's own (plus ``shift`` per token)."""
    out = []
    for n, (text, reward) in enumerate(ANSWERS):
        ids = TOK.encode(text) + [TOK.stop_ids[0]]
        v = learner.version if version is None else version
        t = Trajectory(
            job_id="j",
            episode_id=f"e{n}",
            task_id="t",
            group_id="g",
            reward=reward,
            segments=[
                Segment(role="prompt", token_ids=PROMPT),
                Segment(role="model", token_ids=ids, logprobs=[0.0] * len(ids), policy_version=v),
            ],
        )
        own = learner.logprobs(t)[len(PROMPT) :]
        t.segments[1].logprobs = [
            x + (shift[i] if shift and i < len(shift) else 0.0) for i, x in enumerate(own)
        ]
        out.append(t)
    return out


def weights(learner: Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def test_a_clean_batch_passes_and_only_the_first_step_on_a_versions_weights_is_checked() -> None:
    learner = Learner(create_model(seed=3), LearnerConfig(learning_rate=3e-3), device="cpu")
    tokens = sum(len(TOK.encode(t)) + 1 for t, _ in ANSWERS)
    stats = learner.step([group(learner)])
    assert stats.updated and stats.canary and stats.mismatch_tokens == tokens
    assert stats.mismatch_max < 1e-5 and stats.mismatch_share == 0.0 and not stats.mismatch_failed
    # the weights moved and no version was published: the same version's tokens are not the
    # weights' any more, so nothing is checked (nor failed)
    stats = learner.step([group(learner, version=0)])
    assert not stats.canary and stats.mismatch_tokens == 0
    learner.version = 1  # a publish: the weights are version 1's
    stale = learner.step([group(learner, version=0)])
    assert stale.canary and stale.mismatch_tokens == 0, "a stale batch has nothing to check"
    learner.version = 2
    assert learner.step([group(learner)]).mismatch_tokens == tokens


@pytest.mark.parametrize("on_mismatch", list(OnMismatch))
def test_planted_mismatched_logprobs_are_measured_and_flagged_or_refused(on_mismatch: OnMismatch) -> None:
    cfg = LearnerConfig(
        learning_rate=3e-3, mismatch_tolerance=1e-4, mismatch_max_share=0.1, on_mismatch=on_mismatch
    )
    learner = Learner(create_model(seed=3), cfg, device="cpu")
    shift = [0.0, 0.3, -0.05, 2.0]  # per token of each answer; the rest exact
    batch = group(learner, shift=shift)
    # the reference, by hand: |behaviour - recomputed| of every model token
    gaps = []
    for t in batch:
        own = learner.logprobs(t)[len(PROMPT) :]
        gaps += [abs(b - o) for b, o in zip(t.segments[1].logprobs or [], own, strict=True)]
    before = weights(learner)
    stats = learner.step([batch])
    assert stats.mismatch_tokens == len(gaps)
    assert stats.mismatch_mean == pytest.approx(sum(gaps) / len(gaps), abs=1e-6)
    assert stats.mismatch_max == pytest.approx(max(gaps), abs=1e-6) and max(gaps) == pytest.approx(
        2.0, abs=1e-5
    )
    over = sum(g > 1e-4 for g in gaps)
    planted = sum(1 for t in batch for i in range(len(t.segments[1].token_ids)) if i < 4 and shift[i])
    assert over == planted and stats.mismatch_share == pytest.approx(over / len(gaps))
    assert stats.mismatch_failed
    moved = any(not torch.equal(a, b) for a, b in zip(before, weights(learner), strict=True))
    if on_mismatch is not OnMismatch.flag:  # skip and halt refuse the batch
        assert not stats.updated and stats.refused == REFUSED_MISMATCH and not moved
        assert learner.step([group(learner)]).updated, "the next clean batch trains"
    else:
        assert stats.updated and stats.refused == "" and moved


def test_a_share_under_the_threshold_passes() -> None:
    cfg = LearnerConfig(learning_rate=3e-3, mismatch_max_share=0.5)
    learner = Learner(create_model(seed=3), cfg, device="cpu")
    stats = learner.step([group(learner, shift=[0.0, 0.3])])  # one token of each answer
    assert 0 < stats.mismatch_share < 0.5 and not stats.mismatch_failed and stats.updated
