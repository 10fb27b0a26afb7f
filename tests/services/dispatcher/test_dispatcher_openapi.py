"""The checked-in OpenAPI document is the one the app serves."""

from __future__ import annotations

import json

from services.dispatcher.openapi import DEFAULT_PATH, render


def test_docs_openapi_json_is_up_to_date():
    assert DEFAULT_PATH.exists(), "run: python -m services.dispatcher.openapi"
    assert json.loads(DEFAULT_PATH.read_text()) == json.loads(render()), (
        "docs/openapi.json is stale; regenerate it with: python -m services.dispatcher.openapi"
    )


def test_every_v1_route_is_documented_and_authenticated():
    doc = json.loads(render())
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op.get("summary"), f"{method.upper()} {path} has no summary"
            if path.startswith("/v1/"):
                assert op.get("security") == [{"HTTPBearer": []}], f"{method.upper()} {path}"
                assert "401" in op["responses"], f"{method.upper()} {path} does not document 401"
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml", "multipart/form-data"}
    assert "JobSpec" in doc["components"]["schemas"]
