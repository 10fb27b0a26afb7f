#!/usr/bin/env bash
# Build every wheel the image needs on the host, from requirements.lock, into a wheelhouse
# that `docker build` installs from with --no-index. pip inside a container cannot verify
# TLS here (outgoing HTTPS is re-signed by an authority only the host trusts), so the image
# build needs no network for Python at all. Idempotent: a stamp keyed on the lock skips it.
#   scripts/compose/wheelhouse.sh [DIR]     default: <repo>/.docker/wheels
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/.docker/wheels}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
stamp="$DIR/.lock-$(sha256sum "$ROOT/requirements.lock" | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
mkdir -p "$DIR"
start=$(date +%s)
# --no-deps: the lock is already the whole resolved set. --find-links reuses what a previous
# run saved, so a changed lock downloads only what changed.
"$PY" -m pip wheel -q --no-deps --find-links "$DIR" -r "$ROOT/requirements.lock" -w "$DIR"
rm -f "$DIR"/.lock-*
touch "$stamp"
echo "[wheelhouse] $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $(( $(date +%s) - start ))s"
