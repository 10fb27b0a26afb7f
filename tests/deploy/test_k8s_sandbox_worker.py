"""The rendered sandbox-worker, offline: its image cache is a volume mounted where its
settings point the cache, its workspaces are on a writable volume, and it has the
privileges bubblewrap needs and no more, in the base and under the gVisor overlay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_k8s_env import config_map, env_of, load

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def render(overlay: str) -> list[dict]:
    kustomize = shutil.which("kustomize") or str(Path.home() / ".cache/temper/bin/kustomize")
    if Path(kustomize).exists():
        cmd = [kustomize, "build", overlay]
    else:  # kubectl embeds kustomize
        kubectl = shutil.which("kubectl")
        assert kubectl, "neither kustomize nor kubectl is installed (make check-deploy installs kustomize)"
        cmd = [kubectl, "kustomize", overlay]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def sandbox_worker(overlay: str) -> tuple[dict, dict]:
    [pod] = [
        d["spec"]["template"]["spec"]
        for d in render(overlay)
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "temper-sandbox-worker"
    ]
    [container] = pod["containers"]
    return pod, container


def volume_at(pod: dict, container: dict, path: Path) -> dict:
    """The volume a path lies on: the deepest mount at or above it."""
    mounts = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume (the root filesystem is read-only)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert not mount.get("readOnly")
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return {**volume, "mountPath": mount["mountPath"]}


@pytest.mark.parametrize("overlay", ["k8s", "k8s/overlays/dev", "k8s/overlays/gpu-gvisor"])
def test_the_image_cache_is_a_sized_volume_where_the_settings_point(monkeypatch, overlay):
    pod, container = sandbox_worker(overlay)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    settings = load(monkeypatch, env_of(container, config_map())).sandbox

    cache = volume_at(pod, container, settings.image_cache)
    assert cache["mountPath"] == str(settings.image_cache)  # a volume of its own
    assert cache["name"] == "images" and cache["emptyDir"]["sizeLimit"]
    assert settings.preload_images == []  # documented in the manifest, empty by default
    workspaces = volume_at(pod, container, settings.workspace_root)
    assert workspaces["name"] != "images" and workspaces["emptyDir"]["sizeLimit"]


def test_bubblewrap_gets_an_unmasked_proc_only_in_a_user_namespace():
    pod, container = sandbox_worker("k8s")
    sc = container["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
    assert "add" not in sc["capabilities"] and not sc.get("privileged")
    assert sc["procMount"] == "Unmasked" and pod["hostUsers"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_gvisor_overlay_keeps_its_runtime_and_the_default_proc():
    pod, container = sandbox_worker("k8s/overlays/gpu-gvisor")
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["hostUsers"] is True and container["securityContext"]["procMount"] == "Default"
