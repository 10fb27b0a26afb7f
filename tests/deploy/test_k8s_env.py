"""The k8s manifests' environment is valid Temper settings, offline: every container that
runs a Temper service gets the config map, its own env (secrets as placeholders) and,
for the gateway, each component's patch; the settings load as the service would load them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from temper.runtime import load_settings
from temper.settings.inference import BackendKind

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"


def config_map() -> dict[str, str]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    [gen] = [g for g in kustomization["configMapGenerator"] if g["name"] == "temper-config"]
    return dict(line.split("=", 1) for line in gen["literals"])


def containers(path: Path) -> list[tuple[str, dict]]:
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("containers") or []:
            out.append((doc["metadata"]["name"], c))
    return out


def env_of(container: dict, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for item in container.get("env") or []:
        value = item.get("value")
        if value is None:  # valueFrom: a secret or a field the cluster fills in
            value = "placeholder-" + item["name"].lower()
        env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), "x"), str(value))
    return env


def service_containers() -> list[tuple[str, dict]]:
    found = []
    for path in sorted((K8S / "base").rglob("*.yaml")):
        for name, c in containers(path):
            if c.get("command", [])[:2] == ["python", "-m"] and c["command"][2].startswith("services."):
                found.append((name, c))
    return found


def load(monkeypatch, env: dict[str, str]):  # noqa: ANN201
    import os

    for key in [k for k in os.environ if k.startswith("TEMPER_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings()


def test_every_service_containers_env_is_valid_settings(monkeypatch):
    found = service_containers()
    assert len(found) >= 5, [n for n, _ in found]
    for name, c in found:
        settings = load(monkeypatch, env_of(c, config_map()))
        assert settings.mode.value == "distributed", name


@pytest.mark.parametrize(
    ("component", "kind"),
    [
        ("cpu-server/gateway-backends.yaml", BackendKind.cpu_server),
        ("gpu/gateway-gpu.yaml", BackendKind.vllm),
    ],
)
def test_the_gateway_reads_each_components_backends(monkeypatch, component, kind):
    [(_, gateway)] = [(n, c) for n, c in service_containers() if n == "temper-inference-gateway"]
    [(_, patch)] = containers(K8S / "components" / component)
    env = env_of(patch, env_of(gateway, config_map()))
    backends = load(monkeypatch, env).inference.backends
    assert len(backends) == 1 and backends[0].kind is kind and backends[0].url.startswith("http://temper-")
