"""Print a CustomResourceDefinition for CloudNativePG's `Cluster`, made from Temper's own schema.

CloudNativePG publishes its CRDs on neither registry these machines reach, so this CRD is
written here from deploy/schemas/crds/postgresql.cnpg.io_v1.yaml (the fields Temper's
manifests use). JSON Schema there becomes a structural OpenAPI schema: objects without listed
properties keep their content (x-kubernetes-preserve-unknown-fields), `additionalProperties:
false` is dropped (the API server prunes unknown fields instead), an untyped enum is a string.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value)
            continue
        if key == "properties":
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value)
        elif key == "required" and "properties" not in schema:
            continue
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "array" and "items" not in out:
        out["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return out


def main() -> None:
    source = yaml.safe_load(open(sys.argv[1]))["Cluster"]
    spec = structural(source["properties"]["spec"])
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": "clusters.postgresql.cnpg.io",
            "labels": {"temper.dev/crd-source": "temper-written-from-deploy-schemas"},
        },
        "spec": {
            "group": "postgresql.cnpg.io",
            "names": {
                "kind": "Cluster",
                "listKind": "ClusterList",
                "plural": "clusters",
                "singular": "cluster",
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "spec": spec,
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            },
                        }
                    },
                }
            ],
        },
    }
    yaml.safe_dump(crd, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
