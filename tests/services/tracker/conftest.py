from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services.tracker.mlflow_server import MlflowMissing, MlflowServer


@pytest.fixture
def mlflow_server(tmp_path) -> Iterator[MlflowServer]:
    """A real MLflow server of its own for the test (which may stop and restart it). A missing
    MLflow environment is a failure naming the install step, never a skip."""
    server = MlflowServer(tmp_path / "mlflow")
    try:
        server.start()
    except MlflowMissing as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()
