"""Install a plugin distribution the way pip leaves one: its modules and a
``<name>-<version>.dist-info`` (METADATA, entry_points.txt) in a directory on
``sys.path``, which is exactly where ``importlib.metadata`` finds installed packages."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from temper import plugins

ROOT = Path(__file__).resolve().parents[1]
WORDCOUNT = ROOT / "examples" / "plugins" / "wordcount"


def write_dist(
    site: Path,
    name: str,
    modules: dict[str, str],
    entry_points: dict[str, dict[str, str]],
    version: str = "0.1.0",
) -> None:
    site.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = [
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        for group, eps in entry_points.items()
    ]
    (info / "entry_points.txt").write_text("\n".join(sections))


def project_dist(site: Path, project: Path) -> str:
    """The distribution of a project directory (pyproject.toml and its ``py-modules``)."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    modules = meta["tool"]["setuptools"]["py-modules"]
    write_dist(
        site,
        meta["project"]["name"],
        {m: (project / f"{m}.py").read_text() for m in modules},
        meta["project"]["entry-points"],
        meta["project"]["version"],
    )
    return meta["project"]["name"]


@contextmanager
def on_path(site: Path, *modules: str) -> Iterator[Path]:
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for m in modules:
            sys.modules.pop(m, None)
        plugins.refresh()
