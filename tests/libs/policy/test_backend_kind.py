"""The backend kind of Temper's CPU model server is ``cpu_server``; the old name ``engine``
is refused with a message that names the new one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings


def test_a_backend_with_a_url_is_a_cpu_server_by_default():
    assert BackendSpec(name="e0", url="http://127.0.0.1:8010").kind is BackendKind.cpu_server


def test_the_old_kind_name_is_refused_with_the_new_one():
    with pytest.raises(ValidationError, match="backend kind 'engine' was renamed 'cpu_server'"):
        InferenceSettings.model_validate({"backends": [{"name": "e0", "url": "http://x", "kind": "engine"}]})
