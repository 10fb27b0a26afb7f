"""The ``algorithm`` section of the job spec: presets, overrides, refusals."""

from __future__ import annotations

import pytest

from temper.jobspec import Advantage, Aggregation, Overlong, Precision, SpecError, parse_spec
from temper.training import LearnerConfig

pytestmark = pytest.mark.timeout(30)


def spec(**algorithm):
    return parse_spec(
        {
            "name": "t",
            "policy": {"model": "tiny", "sampling": {"max_tokens": 100}},
            "tasks": {"taskset": "ts"},
            "environment": {"max_turns": 3},
            "algorithm": algorithm,
        }
    )


def test_presets_set_their_parts():
    grpo = spec().algorithm
    assert (grpo.advantage, grpo.aggregation, grpo.clip_eps_high, grpo.overlong) == (
        Advantage.group_norm, Aggregation.token_mean, 0.2, Overlong.keep,
    )  # fmt: skip
    dr = spec(name="dr_grpo").algorithm
    assert (dr.advantage, dr.aggregation, dr.loss_constant) == (
        Advantage.group_mean,
        Aggregation.seq_sum,
        300,
    )
    dapo = spec(name="dapo").algorithm
    assert dapo.clip_eps_high == 0.28 and dapo.dynamic_sampling is False
    assert (dapo.overlong, dapo.overlong_max_tokens, dapo.overlong_buffer) == (Overlong.penalty, 300, 60)
    assert spec(name="rloo").algorithm.advantage is Advantage.leave_one_out


def test_explicit_fields_win_over_the_preset_and_survive_a_round_trip():
    a = spec(name="dapo", clip_eps_high=0.3, overlong="filter", aggregation="seq_mean").algorithm
    assert (a.clip_eps_high, a.overlong, a.aggregation) == (0.3, Overlong.filter, Aggregation.seq_mean)
    again = spec(**a.model_dump(mode="json")).algorithm
    assert again == a


def test_the_learner_gets_every_part():
    a = spec(
        name="dr_grpo", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01,
        max_tokens_per_microbatch=512, gradient_checkpointing=True, precision="fp32",
    ).algorithm  # fmt: skip
    cfg = LearnerConfig.from_spec(a)
    assert cfg.objective().loss_constant == 300 and cfg.objective().kl == "k1"
    assert (cfg.micro_batch_tokens, cfg.gradient_checkpointing, cfg.bf16) == (512, True, False)
    assert a.precision is Precision.fp32


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        (
            {"name": "ppo"},
            "ppo needs a value model, which Temper does not train; allowed: grpo, dr_grpo, dapo, rloo",
        ),
        (
            {"name": "reinforce"},
            "Input should be 'grpo', 'dr_grpo', 'dapo', 'rloo', 'sft', 'dpo' or 'reward_model'",
        ),
        ({"kl_coef": 0.1, "kl_estimator": "none"}, "kl_coef > 0 needs a kl_estimator"),
        (
            {"dynamic_sampling": True, "skip_zero_variance": False},
            "dynamic_sampling needs skip_zero_variance",
        ),
        ({"dynamic_sampling": True, "max_replacement_groups": -1}, "greater than or equal to 0"),
        ({"overlong": "penalty", "overlong_max_tokens": 10, "overlong_buffer": 20}, "must not exceed"),
        ({"aggregation": "per_token"}, "Input should be 'token_mean', 'seq_mean' or 'seq_sum'"),
    ],
)
def test_what_is_not_implemented_is_refused_with_the_allowed_values(algorithm, message):
    with pytest.raises(SpecError) as exc:
        spec(**algorithm)
    path, text = exc.value.errors[0]
    assert path.startswith("algorithm")
    assert message in text
