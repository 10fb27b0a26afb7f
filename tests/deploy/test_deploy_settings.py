"""deploy/tools/settings_check.py, offline: the real compose file and k8s overlays load as
Settings, and a value that would kill a service at start fails, named by service and variable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "deploy" / "tools" / "settings_check.py"
KUSTOMIZE = shutil.which("kustomize") or str(Path.home() / ".cache/temper/bin/kustomize")


def kustomize() -> str:
    """The kustomize binary; `make test` installs it (scripts/check_deploy.sh --tools)."""
    assert Path(KUSTOMIZE).exists(), (
        f"kustomize missing at {KUSTOMIZE}: run bash scripts/check_deploy.sh --tools"
    )
    return KUSTOMIZE


def run_check(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}
    return subprocess.run(
        [sys.executable, str(CHECK), *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_the_compose_files_load():
    for files in (["docker-compose.yml"], ["docker-compose.yml", "deploy/compose/local-servers.yml"]):
        result = run_check("compose", *files)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "9 Temper environments load as Settings" in result.stdout


def test_a_bad_compose_value_fails_naming_service_and_variable(tmp_path):
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # No scheme: the gateway would die at start parsing its backends.
    doc["services"]["inference-gateway"]["environment"]["TEMPER_INFERENCE__BACKENDS"] = "cpu-server:8010"
    doc["services"]["trainer"]["environment"]["TEMPER_DISPATCHER__LEASE_S"] = "soon"
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_check("compose", bad)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any("inference-gateway" in line and "invalid settings" in line for line in lines), result.stdout
    assert "TEMPER_INFERENCE__BACKENDS" in result.stdout and "not an http(s) URL" in result.stdout
    assert "TEMPER_DISPATCHER__LEASE_S" in result.stdout
    assert "dispatcher:" not in result.stdout  # the others still load


def test_the_images_own_env_is_checked_under_every_service(tmp_path):
    # Every container inherits the Dockerfile's ENV: a retired variable there stops every
    # service at start (it did: TEMPER_API__HOST, found by the first run on Kubernetes).
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        (ROOT / "Dockerfile").read_text().replace("TEMPER_HOST=0.0.0.0", "TEMPER_API__HOST=0.0.0.0")
    )
    result = run_check(f"--dockerfile={dockerfile}", "compose", "docker-compose.yml")
    assert result.returncode == 1
    failing = [line for line in result.stdout.splitlines() if "TEMPER_API__HOST" in line]
    assert len(failing) == 9, result.stdout  # every Temper service of the compose file
    assert all("use TEMPER_HOST" in line for line in failing)
    assert run_check("compose", "docker-compose.yml").returncode == 0  # the real one loads


def test_a_missing_required_compose_variable_fails(tmp_path):
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    doc["services"]["dispatcher"]["environment"]["TEMPER_LOG__LEVEL"] = "${NOT_IN_THE_EXAMPLE:?set it}"
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_check("compose", bad)
    assert result.returncode == 1 and "NOT_IN_THE_EXAMPLE" in result.stdout + result.stderr


@pytest.mark.parametrize(
    "overlay", ["k8s", "k8s/overlays/dev", "k8s/overlays/gpu", "k8s/overlays/gpu-gvisor"]
)
def test_each_rendered_overlay_loads(tmp_path, overlay):
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(
        subprocess.run(
            [kustomize(), "build", overlay], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    )
    result = run_check("k8s", rendered)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_bad_config_map_value_fails_every_service_that_reads_it(tmp_path):
    text = subprocess.run(
        [kustomize(), "build", "k8s/overlays/dev"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    docs = list(yaml.safe_load_all(text))
    [config] = [
        d
        for d in docs
        if d and d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("temper-config")
    ]
    config["data"]["TEMPER_MODE"] = "clustered"
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = run_check("k8s", rendered)
    assert result.returncode == 1
    assert "TEMPER_MODE" in result.stdout
    assert result.stdout.count("invalid settings") == 9, result.stdout  # every Temper container
    assert "temper-dispatcher/temper-dispatcher" in result.stdout
