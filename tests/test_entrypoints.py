"""Every ``python -m <module>`` that the deployment files, scripts and docs name is a
module of this tree (so a move of a module cannot leave a stale command behind)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    ROOT / "docker-compose.yml",
    ROOT / "Dockerfile",
    ROOT / "Makefile",
    ROOT / "README.md",
    *sorted((ROOT / "k8s").rglob("*.yaml")),
    *sorted((ROOT / "scripts").rglob("*.sh")),
    *sorted((ROOT / "docs").glob("*.md")),
]
# python -m X | "-m", "X" | YAML list items "- -m" then "- X"
MODULE = re.compile(r"""-m["']?(?:,\s*|\s+|\s*\n\s*-\s+)["']?((?:services|temper)(?:\.\w+)+)""")


def commands() -> list[tuple[str, str]]:
    found = []
    for path in FILES:
        for name in MODULE.findall(path.read_text()):
            found.append((str(path.relative_to(ROOT)), name))
    return found


def runnable(module: str) -> bool:
    top, *rest = module.split(".")
    base = ROOT / ("libs" if top == "temper" else "") / top / Path(*rest) if rest else ROOT / top
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def test_every_named_module_exists() -> None:
    named = commands()
    assert {"services.worker", "services.inference_gateway.cpu_server", "services.dispatcher"} <= {
        module for _, module in named
    }, "the pattern no longer finds the deployment's commands"
    missing = [f"{where}: python -m {module}" for where, module in named if not runnable(module)]
    assert missing == []


def test_a_moved_module_would_be_found() -> None:
    assert MODULE.findall('command: ["python", "-m", "services.dispatcher.engine"]') == [
        "services.dispatcher.engine"
    ]
    assert MODULE.findall("        - -m\n        - services.worker\n") == ["services.worker"]
    assert not runnable("services.dispatcher.engine") and runnable("services.worker")
