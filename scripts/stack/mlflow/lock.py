"""Re-resolve scripts/stack/mlflow/requirements.txt (stdlib only).

    python3.11 scripts/stack/mlflow/lock.py

The MLflow tracking server the tests log to runs from an environment of its own
(install.sh), never from Temper's: Temper talks to it over its REST API only.

mlflow 3.18.0 requires ``mlflow-tracing==3.18.0``, which the package index does not serve
(its newest is 3.17.2), so no resolver can lock it as published. ``mlflow-tracing`` is the
tracing-only subset of the ``mlflow`` package that ``mlflow-skinny==3.18.0`` already holds
whole (installing 3.17.2's would overwrite some of 3.18.0's files with older ones), so it
is left out: this resolves mlflow's other ``Requires-Dist`` lines with pip's dry-run
report for this Python and platform, adds the mlflow wheel itself, and writes every line
with the sha256 the index publishes; install.sh installs with ``--require-hashes --no-deps``
and proves the server starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MLFLOW = "mlflow==3.18.0"
DROPPED = {"mlflow-tracing"}


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--quiet", *args], check=True)


def report(venv: Path, out: Path, *args: str) -> list[dict]:
    pip(
        venv,
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary",
        ":all:",
        "--report",
        str(out),
        *args,
    )
    return json.loads(out.read_text())["install"]


def line(item: dict) -> str:
    meta, info = item["metadata"], item["download_info"]
    return f"{meta['name']}=={meta['version']} --hash=sha256:{info['archive_info']['hashes']['sha256']}"


def requires(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines without extras and without :data:`DROPPED`."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    out = []
    for raw in text.splitlines():
        req = raw.removeprefix("Requires-Dist: ")
        if req == raw or "extra ==" in req:
            continue
        if re.split(r"[\s=<>!~;\[]", req, maxsplit=1)[0].lower() not in DROPPED:
            out.append(req)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip(venv, "download", "--no-deps", "--only-binary", ":all:", "-d", str(tmp), MLFLOW)
        [wheel] = tmp.glob("mlflow-*.whl")
        deps = tmp / "deps.in"
        deps.write_text("\n".join(requires(wheel)) + "\n")
        resolved = report(venv, tmp / "deps.json", "-r", str(deps))
        [own] = report(venv, tmp / "own.json", "--no-deps", MLFLOW)
        header = [
            f"# {MLFLOW} (the tracking server) and what it runs on, for scripts/stack/mlflow/install.sh",
            "# (pip install --require-hashes --no-deps). Written by scripts/stack/mlflow/lock.py for Python "
            f"{sys.version_info.major}.{sys.version_info.minor}, linux x86_64; do not edit by hand.",
            "# mlflow-tracing==3.18.0 is left out: the index does not serve it, and mlflow-skinny==3.18.0",
            "# holds all of its files (lock.py says why).",
        ]
        lines = sorted({line(i) for i in resolved} | {line(own)}, key=str.lower)
        (HERE / "requirements.txt").write_text("\n".join([*header, *lines]) + "\n")
        print(f"{len(lines)} packages in {HERE / 'requirements.txt'}")


if __name__ == "__main__":
    main()
