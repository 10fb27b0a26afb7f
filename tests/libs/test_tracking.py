"""The spec as tracking params: flattened with dots, secrets never in them; the W&B spec's door;
what a W&B run holds and what it writes next (no wandb process needed)."""

from __future__ import annotations

import json

import pytest

from temper.jobspec import JobSpec, SpecError, parse_spec
from temper.tracking import flatten, flatten_values, is_secret
from temper.tracking.params import REDACTED
from temper.tracking.wandb_offline import RunLog


@pytest.mark.parametrize(
    "key", ["api_key", "hf_token", "HF_TOKEN", "dbPassword", "secret", "aws_secret_access_key", "key", "AccessKey",
            "client-secret", "credentials", "auth"],
)  # fmt: skip
def test_secret_keys(key):
    assert is_secret(key)


@pytest.mark.parametrize(
    "key", ["max_tokens", "tokens", "checkpoint_key", "keep", "monkey", "kl_coef", "author"]
)
def test_not_secret_keys(key):
    assert not is_secret(key)


def test_flatten_the_resolved_spec():
    spec = JobSpec.model_validate({
        "name": "j",
        "policy": {"model": "m", "sampling": {"stop": ["\n\n"]}},
        "tasks": {"taskset": "ts-1", "group_size": 2},
        "algorithm": {"learning_rate": 3e-5, "lora": {"rank": 8}},
        "schedule": {"episodes_per_iteration": 4},
        "tracking": {"mlflow": {"uri": "http://mlflow:5000/"}},
    }).model_dump(mode="json")  # fmt: skip
    params = flatten(spec)
    assert params["algorithm.learning_rate"] == "3e-05"
    assert params["algorithm.lora.rank"] == "8"
    assert params["policy.sampling.stop"] == '["\\n\\n"]'
    assert params["policy.init"] == "None" and params["algorithm.skip_zero_variance"] == "true"
    assert params["tracking.mlflow.uri"] == "http://mlflow:5000"  # the trailing slash dropped at the door
    assert params["tracking.mlflow.experiment"] == "temper"


def test_secrets_are_redacted_at_any_depth():
    params = flatten({
        "environment": {"env": {"HF_TOKEN": "hf_abc", "MODE": "fast"}, "services": [{"db_password": "pw1", "port": 5}]},
        "api_key": "sk-123",
        "storage": {"credentials": {"user": "u", "pass": "p"}},
    })  # fmt: skip
    assert params == {
        "environment.env.HF_TOKEN": REDACTED,
        "environment.env.MODE": "fast",
        "environment.services": f'[{{"db_password":"{REDACTED}","port":5}}]',
        "api_key": REDACTED,
        "storage.credentials": REDACTED,
    }
    assert not any(s in v for v in params.values() for s in ("hf_abc", "pw1", "sk-123", '"p"'))


def test_tracking_is_optional_and_checked():
    base = {"name": "j", "policy": {"model": "m"}, "tasks": {"taskset": "t"}}
    assert JobSpec.model_validate(base).tracking.mlflow is None
    with pytest.raises(SpecError) as exc:
        parse_spec({**base, "tracking": {"mlflow": {"uri": "mlflow:5000"}}})
    assert exc.value.errors[0][0] == "tracking.mlflow.uri"
    with pytest.raises(SpecError) as exc:
        parse_spec({**base, "tracking": {"mlflow": {"uri": "http://m:5000", "experiment": ""}}})
    assert exc.value.errors[0][0] == "tracking.mlflow.experiment"


def test_wandb_is_offline_only():
    base = {"name": "j", "policy": {"model": "m"}, "tasks": {"taskset": "t"}}
    spec = parse_spec({**base, "tracking": {"wandb": {"project": "code-agents"}}})
    assert spec.tracking.wandb is not None and spec.tracking.wandb.mode.value == "offline"
    for mode in ("online", "shared", "disabled"):
        with pytest.raises(SpecError) as exc:
            parse_spec({**base, "tracking": {"wandb": {"project": "p", "mode": mode}}})
        assert exc.value.errors[0][0] == "tracking.wandb.mode"
        assert f"only 'offline' is supported (got '{mode}')" in exc.value.errors[0][1]


def test_flatten_values_keeps_types_and_redacts_alike():
    spec = {"algorithm": {"learning_rate": 3e-5, "lora": {}}, "policy": {"init": None, "stop": ["x"]},
            "schedule": {"iterations": 3}, "skip": True, "env": {"HF_TOKEN": "hf_abc"}}  # fmt: skip
    values = flatten_values(spec)
    assert values == {"algorithm.learning_rate": 3e-5, "algorithm.lora": "{}", "policy.init": None,
                      "policy.stop": '["x"]', "schedule.iterations": 3, "skip": True,
                      "env.HF_TOKEN": REDACTED}  # fmt: skip
    assert flatten(spec) == {k: "None" if v is None else v if isinstance(v, str) else json.dumps(v)
                             for k, v in values.items()}  # fmt: skip


def test_a_wandb_run_writes_only_what_it_lacks():
    held = RunLog()
    held.add([
        {"type": "run", "run": {"run_id": "job-1"}},
        {"type": "history", "history": {"item": {"_step": 0, "policy_version": 1, "train/loss": 0.5}}},
        {"type": "history", "history": {"item": {"_step": 1, "iteration": 0, "rollout/reward_mean": 0.25,
                                                  "rollout/episodes": 2}}},
        {"type": "summary", "summary": {"update": {"temper.state": "running", "_runtime": 3}}},
        {"type": "preempting", "preempting": {}},
        {"type": "exit", "exit": {"exit_code": 0}},
    ])  # fmt: skip
    assert held.next_step == 2 and held.summary == {"temper.state": "running"}
    assert held.exit_code is None  # closed as preempting: not the job's end
    assert held.logged == {("policy_version", 1): {"train/loss": 0.5},
                           ("iteration", 0): {"rollout/reward_mean": 0.25, "rollout/episodes": 2}}  # fmt: skip
    rows = held.rows([
        ("train/loss", 0.5, 10, 1),  # held
        ("rollout/reward_mean", 0.25, 11, 0), ("rollout/episodes", 4.0, 11, 0),  # one changed
        ("train/loss", 0.4, 12, 2), ("train/kl", 0.1, 12, 2),
        ("train/loss", 0.3, 13, 2),  # the later point of a key wins
        ("other/x", 1.0, 14, 2),  # no step axis: not written
    ])  # fmt: skip
    assert rows == [("iteration", 0, {"rollout/episodes": 4.0}, 11),
                    ("policy_version", 2, {"train/loss": 0.3, "train/kl": 0.1}, 13)]  # fmt: skip
    ended = RunLog()
    ended.add([{"type": "exit", "exit": {}}])
    assert ended.exit_code == 0 and ended.files == 1
