"""docker-compose.yml's sandbox containers, offline: least privilege as docs/compose.md
describes it (no capability, no privileged container, the bubblewrap seccomp profile), and
that profile allows what bubblewrap calls while refusing the kernel-wide calls."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SANDBOXED = ("sandbox-worker", "reward-scorer")


def services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_no_service_is_privileged_and_only_the_sandboxes_lift_docker_defaults():
    for name, svc in services().items():
        assert not svc.get("privileged"), name
        assert not svc.get("cap_add"), name
        if name not in SANDBOXED:
            assert not svc.get("security_opt"), name


def test_the_sandbox_containers_drop_every_capability_and_use_the_profile():
    for name in SANDBOXED:
        svc = services()[name]
        assert svc["cap_drop"] == ["ALL"], name
        opts = svc["security_opt"]
        assert "seccomp=./deploy/compose/seccomp-sandbox.json" in opts, name
        assert "seccomp=unconfined" not in opts, name
        assert {"systempaths=unconfined", "no-new-privileges:true"} <= set(opts), name
        env = svc["environment"]
        # ALLOW_UNSAFE is only for the missing cgroups: the backend stays bubblewrap.
        assert env["TEMPER_SANDBOX__BACKEND"] == "bwrap", name


def test_the_profile_allows_bubblewrap_and_refuses_the_kernel_wide_calls():
    profile = json.loads((ROOT / "deploy/compose/seccomp-sandbox.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" for n in rule["names"]}
    for needed in ("unshare", "clone", "clone3", "mount", "umount2", "pivot_root", "setns"):
        assert needed not in denied, needed
    for refused in ("kexec_load", "init_module", "finit_module", "bpf", "perf_event_open", "keyctl",
                    "open_by_handle_at", "reboot", "userfaultfd", "fsopen"):  # fmt: skip
        assert refused in denied, refused
