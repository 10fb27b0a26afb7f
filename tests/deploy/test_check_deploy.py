"""scripts/check_deploy.sh passes on the repository, and its alert tests can fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold run builds kustomize from source
def test_check_deploy_passes() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_deploy.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check-deploy: all passed" in proc.stdout


@pytest.mark.timeout(60)
def test_promtool_reports_a_broken_rule(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup_system.sh installs Debian's prometheus package"
    rules = (PROM / "rules.yml").read_text()
    broken = rules.replace(
        "max by (instance) (temper_sandbox_leaked_processes) > 0",
        "max by (instance) (temper_sandbox_leaked_processes) > 5",
    )
    assert broken != rules, "the rule this test breaks is gone from rules.yml"
    (tmp_path / "rules.yml").write_text(broken)
    shutil.copy(PROM / "rules_test.yml", tmp_path / "rules_test.yml")

    proc = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], cwd=tmp_path, capture_output=True, text=True
    )

    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "FAILED" in out and "TemperSandboxLeakedProcesses" in out


@pytest.mark.timeout(60)
def test_unchanged_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup_system.sh installs Debian's prometheus package"
    proc = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_a_scaler_naming_the_broker_without_its_namespace_fails(tmp_path: Path) -> None:
    """KEDA's operator resolves bootstrapServers from its own namespace: a bare Service name
    never resolves there (the ScaledObjects stayed unready on the first real cluster)."""
    kustomize = shutil.which("kustomize") or str(Path.home() / ".cache/temper/bin/kustomize")
    rendered = subprocess.run(
        [kustomize, "build", "k8s/overlays/dev"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    check = [
        sys.executable,
        str(ROOT / "deploy" / "tools" / "deploycheck.py"),
        "topics",
    ]
    good = tmp_path / "good.yaml"
    good.write_text(rendered)
    assert subprocess.run([*check, str(good)], capture_output=True, text=True).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        rendered.replace("temper-kafka-kafka-bootstrap.temper.svc:9092", "temper-kafka-kafka-bootstrap:9092")
    )
    proc = subprocess.run([*check, str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout.count("is not qualified with its namespace temper") == 3, proc.stdout
