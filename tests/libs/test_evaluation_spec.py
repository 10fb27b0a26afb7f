"""The ``evaluation`` section of a job spec and the ``evaluate`` of an evaluation job: a k
above the samples, an unknown "passed" rule, a threshold without a rule, and an ``evaluate``
sent with a submitted spec are refused, each naming what is wrong; defaults resolve."""

from __future__ import annotations

import pytest

from temper.jobspec import JobSpec, SpecError, Split, parse_spec

BASE = {"name": "e", "policy": {"model": "m"}, "tasks": {"taskset": "ts"}}


def spec(**evaluation) -> JobSpec:
    return parse_spec({**BASE, "evaluation": {"every_versions": 2, **evaluation}})


def refused(data: dict) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return str(info.value)


def test_defaults_resolve_to_the_jobs_held_out_part_and_the_default_verdict():
    s = spec(samples=4, pass_at=[4, 1, 2])
    ev = s.evaluation
    assert ev is not None and ev.split is Split.held_out and ev.taskset is None
    assert ev.pass_at == [1, 2, 4] and ev.passed_by == "default" and ev.pass_threshold is None
    assert ev.sampling is None and ev.label == "eval"
    other = spec(taskset="ts-other")
    assert other.evaluation is not None and other.evaluation.split is Split.all  # another set: all of it
    by_reward = spec(passed_by="reward")
    assert by_reward.evaluation is not None and by_reward.evaluation.pass_threshold == 1.0
    # the stored spec validates again to itself
    stored = s.model_dump(mode="json")
    assert JobSpec.model_validate(stored).model_dump(mode="json") == stored


def test_a_k_above_the_samples_is_refused():
    msg = refused({**BASE, "evaluation": {"every_versions": 1, "samples": 4, "pass_at": [1, 8]}})
    assert "k=8 exceeds samples (4)" in msg and "evaluation" in msg


@pytest.mark.parametrize(
    "evaluation,words",
    [
        ({"every_versions": 0}, "greater than or equal to 1"),
        ({"every_versions": 1, "pass_at": [1, 1]}, "repeats a k"),
        ({"every_versions": 1, "pass_at": []}, "at least 1 item"),
        (
            {"every_versions": 1, "passed_by": "coverage"},
            "'coverage' is not default, reward or one of the job's rewards",
        ),
        ({"every_versions": 1, "pass_threshold": 0.5}, "pass_threshold applies with passed_by reward"),
        ({"every_versions": 1, "split": "test"}, "evaluation.split"),
        ({"every_versions": 1, "label": "a b"}, "evaluation.label"),
        ({"samples": 1}, "evaluation.every_versions: Field required"),
    ],
)
def test_bad_sections_are_refused_naming_the_problem(evaluation, words):
    assert words in refused({**BASE, "evaluation": evaluation})


def test_a_component_rule_names_one_of_the_jobs_rewards():
    s = parse_spec({**BASE, "rewards": {"tests_passed": 1.0, "coverage": 0.2},
                    "evaluation": {"every_versions": 1, "passed_by": "coverage", "pass_threshold": 0.8}})  # fmt: skip
    assert s.evaluation is not None and (s.evaluation.passed_by, s.evaluation.pass_threshold) == (
        "coverage",
        0.8,
    )


def test_an_evaluate_section_is_the_servers_and_an_sft_job_has_no_evaluation():
    msg = refused({**BASE, "evaluate": {"job": "job-1", "version": 2}})
    assert "evaluate: is set by the server" in msg and "/evaluations" in msg
    msg = refused({**BASE, "algorithm": {"name": "sft"}, "evaluation": {"every_versions": 1}})
    assert "evaluation: applies to RL jobs only" in msg
    with pytest.raises(ValueError, match="names a version or a model directory"):
        JobSpec.model_validate({**BASE, "evaluate": {"job": "job-1"}})
    with pytest.raises(ValueError, match="has no evaluation of its own"):
        JobSpec.model_validate(
            {**BASE, "evaluate": {"job": "job-1", "version": 1}, "evaluation": {"every_versions": 1}}
        )
