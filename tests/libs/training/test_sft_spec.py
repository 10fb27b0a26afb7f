"""The specs of jobs without episodes (sft, dpo, reward_model): RL-only fields refused (at
the door even at their default, on every validation when changed), batch_size and
epochs, dpo's beta, the job-version syntax of policy.init."""

from __future__ import annotations

import pytest

from temper.jobspec import JobSpec, SpecError, job_reference, parse_spec


def doc(**fields) -> dict:
    return {
        "name": "s",
        "policy": {"model": "m"},
        "tasks": {"taskset": "ts"},
        "algorithm": {"name": "sft"},
        **fields,
    }


def test_an_sft_spec_takes_batch_size_and_epochs_and_survives_its_stored_form():
    spec = parse_spec(doc(algorithm={"name": "sft", "batch_size": 4}, schedule={"iterations": 3}))
    assert spec.is_sft and spec.algorithm.batch_size == 4
    assert spec.sft_steps(10) == (3, 9)  # ceil(10 / 4) steps an epoch
    # every conversation once an epoch, the last batch smaller; the order is the seed's
    epoch = [i for k in range(3) for i in spec.sft_batch(10, k)]
    assert sorted(epoch) == list(range(10)) and len(spec.sft_batch(10, 2)) == 2
    second = [i for k in range(3, 6) for i in spec.sft_batch(10, k)]
    assert sorted(second) == list(range(10)) and second != epoch  # each epoch its own shuffle
    assert spec.sft_batch(10, 4) == parse_spec(doc(algorithm={"name": "sft", "batch_size": 4})).sft_batch(
        10, 4
    )
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec
    assert parse_spec(doc()).algorithm.batch_size == 8


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"algorithm": {"name": "sft", "clip_eps": 0.2}}, "algorithm.clip_eps"),  # its default, still refused
        ({"algorithm": {"name": "sft", "kl_coef": 0.1}}, "algorithm.kl_coef"),
        ({"algorithm": {"name": "sft", "groups_per_step": 2}}, "algorithm.groups_per_step"),
        ({"tasks": {"taskset": "ts", "group_size": 4}}, "tasks.group_size"),
        ({"rewards": {"tests_passed": 1.0}}, "rewards"),
        ({"environment": {"kind": "code"}}, "environment"),
        ({"schedule": {"episodes_per_iteration": 16}}, "schedule.episodes_per_iteration"),
        ({"policy": {"model": "m", "sampling": {"temperature": 0.5}}}, "policy.sampling"),
    ],
)
@pytest.mark.parametrize("algorithm", ["sft", "dpo", "reward_model"])
def test_rl_only_fields_are_refused_for_jobs_without_episodes(fields, path, algorithm):
    if "algorithm" in fields:
        fields = {**fields, "algorithm": {**fields["algorithm"], "name": algorithm}}
    else:
        fields = {**fields, "algorithm": {"name": algorithm}}
    with pytest.raises(SpecError) as exc:
        parse_spec(doc(**fields))
    refusal = "applies to RL jobs only; an sft, dpo or reward_model job runs no episodes (leave it out)"
    assert (path, refusal) in exc.value.errors


def test_a_stored_sft_spec_with_a_changed_rl_field_is_refused_on_validation():
    stored = parse_spec(doc()).model_dump(mode="json")
    stored["algorithm"]["kl_coef"] = 0.1
    with pytest.raises(ValueError, match="algorithm.kl_coef: applies to RL jobs only"):
        JobSpec.model_validate(stored)


def test_batch_size_and_beta_belong_to_their_algorithms():
    with pytest.raises(SpecError, match="batch_size applies to sft, dpo and reward_model only"):
        parse_spec(doc(algorithm={"name": "grpo", "batch_size": 4}))
    dpo = parse_spec(doc(algorithm={"name": "dpo", "batch_size": 4}))
    assert dpo.is_offline and not dpo.is_sft and dpo.algorithm.beta == 0.1 and dpo.data_kind == "preference"
    assert parse_spec(doc(algorithm={"name": "dpo", "beta": 0.5})).algorithm.beta == 0.5
    for name in ("sft", "reward_model", "grpo"):
        with pytest.raises(SpecError, match="beta applies to dpo only"):
            parse_spec(doc(algorithm={"name": name, "beta": 0.5}))
    rm = parse_spec(doc(algorithm={"name": "reward_model"}))
    assert rm.data_kind == "preference" and rm.algorithm.batch_size == 8
    with pytest.raises(SpecError, match="a reward_model job trains full weights"):
        parse_spec(doc(algorithm={"name": "reward_model", "lora": {"rank": 4}}))
    with pytest.raises(SpecError, match="ppo needs a value model"):
        parse_spec(doc(algorithm={"name": "ppo"}))


def test_the_job_version_syntax_of_policy_init():
    assert job_reference("job:sft-words@v12") == ("sft-words", 12)
    assert job_reference("job:job-abc123@latest") == ("job-abc123", None)
    assert job_reference("tenants/t/jobs/j/versions/v1") is None
    for bad in ("job:x", "job:x@12", "job:X@v1", "job:x@v1/extra"):
        with pytest.raises(SpecError, match="job:<job id or handle>@v<N>"):
            parse_spec(doc(policy={"model": "m", "init": bad}))
