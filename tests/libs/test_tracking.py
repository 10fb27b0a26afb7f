"""The spec as tracking params: flattened with dots, secrets never in them."""

from __future__ import annotations

import pytest

from temper.jobspec import JobSpec, SpecError, parse_spec
from temper.tracking import flatten, is_secret
from temper.tracking.params import REDACTED


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
