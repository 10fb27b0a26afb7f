"""Clean logprobs pass the trainer's logprob canary: what the CPU model runner samples, on
its base weights and with a job's LoRA adapter, checked by the learner that holds the same
weights (vLLM's: test_vllm_server.py). A planted offset on the same rows fails it, so the
pass is not a comparison that cannot fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.inference_gateway.cpu_server.runner import GenOutput, GenRequest, ModelRunner, SamplingParams
from temper.jobspec import LoraSpec
from temper.policy import create_model, default_tokenizer, encode_chat
from temper.training import Learner, LearnerConfig, StepStats
from temper.trajectory import Segment, Trajectory

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()
PROMPTS = [
    encode_chat(TOK, [{"role": "user", "content": q}]) for q in ("Is it?", "What is 2+2?", "Name one.")
]


def trajectories(outs: list[GenOutput], version: int, shift: float = 0.0) -> list[Trajectory]:
    return [
        Trajectory(
            job_id="j",
            episode_id=f"e{i}",
            task_id="t",
            group_id="g",
            reward=float(i % 2),  # a group with reward variance: the step trains on it
            segments=[
                Segment(role="prompt", token_ids=o.prompt_ids),
                Segment(
                    role="model",
                    token_ids=o.token_ids,
                    logprobs=[x + shift for x in o.logprobs],
                    policy_version=version,
                ),
            ],
        )
        for i, o in enumerate(outs)
    ]


def sample(runner: ModelRunner, job: str | None) -> list[GenOutput]:
    rows = [
        GenRequest(p, SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True), job_id=job)
        for s, p in enumerate(PROMPTS * 2)
    ]
    return runner.generate(rows)


def checked(learner: Learner, outs: list[GenOutput], version: int, shift: float = 0.0) -> StepStats:
    stats = learner.step([trajectories(outs, version, shift)])
    assert stats.canary and stats.mismatch_tokens == sum(len(o.token_ids) for o in outs)
    return stats


def test_the_cpu_runners_base_weights_pass_and_a_planted_offset_fails() -> None:
    runner = ModelRunner(create_model(seed=5), TOK)
    outs = sample(runner, None)
    assert {o.policy_version for o in outs} == {0}
    clean = checked(Learner(create_model(seed=5), LearnerConfig(), device="cpu"), outs, 0)
    assert not clean.mismatch_failed and clean.mismatch_max < 1e-4
    planted = checked(Learner(create_model(seed=5), LearnerConfig(), device="cpu"), outs, 0, shift=0.01)
    assert planted.mismatch_failed and planted.mismatch_mean == pytest.approx(0.01, abs=1e-4)


def lora_learner() -> Learner:
    """A learner whose adapter is moved far from zero (lora_B starts at 0), at version 1."""
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    learner = Learner(create_model(seed=5), LearnerConfig(lora=spec), device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    learner.version = 1  # as published: the weights are version 1's
    return learner


def test_a_jobs_adapter_on_the_cpu_runner_passes_against_its_learner(tmp_path: Path) -> None:
    learner = lora_learner()
    learner.model.save_pretrained(str(tmp_path / "adapter"))
    runner = ModelRunner(create_model(seed=5), TOK)
    runner.load_adapter(tmp_path / "adapter", job_id="job-a", version=1)
    outs = sample(runner, "job-a")
    assert {o.policy_version for o in outs} == {1} and {o.adapter for o in outs} == {"job-a-v1"}
    stats = checked(learner, outs, 1)
    assert not stats.mismatch_failed and stats.mismatch_max < 1e-4
    # the base's tokens and logprobs labelled as the adapter's version: the canary fails them
    base = sample(ModelRunner(create_model(seed=5), TOK), None)
    wrong = checked(lora_learner(), base, 1)
    assert wrong.mismatch_failed and wrong.mismatch_mean > 1e-2
