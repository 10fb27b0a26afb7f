"""Without the environment of scripts/stack/mlflow/install.sh the tests fail naming the
install step (the fixture turns this into a failure, never a skip)."""

from __future__ import annotations

import pytest

from tests.services.tracker import mlflow_server


def test_a_missing_mlflow_environment_names_make_stack_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(mlflow_server, "ROOT", tmp_path / "checkout")
    with pytest.raises(
        mlflow_server.MlflowMissing, match=r"run `make stack-up` \(or scripts/stack/mlflow/install.sh\)"
    ):
        mlflow_server.mlflow_python()
