#!/usr/bin/env bash
# Wheels of what Temper's training library imports and a GPU machine's own image lacks
# (it has torch, transformers, peft, safetensors, tokenizers, numpy, urllib3, certifi; not
# pydantic, orjson or minio, which temper.jobspec, temper.trajectory (through temper.events)
# and temper.storage import),
# at requirements.lock's versions, for that machine's Python 3.12 on x86-64, into
# .gpu-wheels/ (git-ignored, about 6 MB). Carry that folder to the machine; `make
# gpu-check` installs them into a folder of their own there (docs/training.md, "The GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
NAMES=(pydantic pydantic-core annotated-types typing-inspection pydantic-settings python-dotenv
       orjson minio argon2-cffi argon2-cffi-bindings cffi pycparser pycryptodome)
PY=${PY:-.venv/bin/python}
pins=()
for name in "${NAMES[@]}"; do
  pin=$(grep -i "^${name}==" requirements.lock) || { echo "gpu_wheels: $name is not in requirements.lock" >&2; exit 1; }
  pins+=("$pin")
done
rm -rf .gpu-wheels
mkdir -p .gpu-wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu-wheels "${pins[@]}"
echo "gpu_wheels: $(ls .gpu-wheels | wc -l) wheels, $(du -sh .gpu-wheels | cut -f1) in .gpu-wheels/"
