"""requirements.lock pins what setup installs: every dependency pyproject.toml names is
pinned there at a version its range allows, and the environment the tests run in holds
exactly the pinned versions (so CI tests what a fresh clone gets)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        names += extra
    return [Requirement(r) for r in names]


def test_every_declared_dependency_is_pinned_within_its_range() -> None:
    pins = _locked()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, (
            f"{req.name} is declared in pyproject.toml but not in requirements.lock (make lock)"
        )
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier} (make lock)"
        )


def test_installed_versions_are_the_locked_ones() -> None:
    drift = []
    for name, version in _locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift.append(f"{name}: locked {version}, not installed")
            continue
        if installed != version:
            drift.append(f"{name}: locked {version}, installed {installed}")
    assert not drift, "the environment differs from requirements.lock (run make setup):\n" + "\n".join(drift)
