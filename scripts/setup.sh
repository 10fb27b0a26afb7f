#!/usr/bin/env bash
# Create .venv and install Temper with its dev tools. Idempotent: it reinstalls only
# when pyproject.toml changed since the last install. pip's own cache (~/.cache/pip)
# keeps the large wheels (torch and its CUDA libraries from PyPI, ~3 GB unpacked) so a
# second clone on the same machine installs in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Temper needs Python 3.11, found {sys.version}"'

# A .venv whose creation was cut short (no pip in it) is made again.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "setup: .venv has no pip (its creation was interrupted): making it again"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# The stamp covers both files: the lock pins what is installed, pyproject.toml the package itself.
stamp=".venv/.temper-installed-$(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && .venv/bin/python -c 'import temper, services' 2>/dev/null; then
  exit 0
fi
# shellcheck source=scripts/disk.sh
source scripts/disk.sh
require_free_gb 7 .venv "installing Temper's environment (.venv is about 6.6 GB: torch with its CUDA libraries)"
start=$(date +%s)
.venv/bin/python -m pip install -q --upgrade pip
# torch from PyPI is the CUDA build; it runs on CPU, and the same wheel uses a GPU when one is there.
# Exactly the versions in requirements.lock (what CI tested), then Temper itself without
# resolving anything again. `make lock` re-resolves the lock from pyproject.toml's ranges.
.venv/bin/python -m pip install -q -r requirements.lock
.venv/bin/python -m pip install -q --no-deps -e .
rm -f .venv/.temper-installed-*
touch "$stamp"
echo "setup: installed in $(( $(date +%s) - start ))s"
