#!/usr/bin/env bash
# The sandbox image examples/agent-job.yaml runs its agent on: Debian bookworm (python3 3.11,
# the Python Temper's lock is resolved for) with the agent's Python packages, openai and
# what it needs, at requirements.lock's versions. The wheels are downloaded here, on the
# host, and installed in the image by its own pip with --no-index (docs/agents.md): the
# image never reaches a package registry.
#
#   bash scripts/agent_image.sh [OUTPUT]    # default $TEMPER_CACHE_DIR/images/agent-bookworm.tar.gz
#
# Needs mmdebstrap and root (scripts/setup_system.sh images); about two minutes, 80 MB.
# Prints the image's digest. Idempotent: an existing OUTPUT is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${TEMPER_CACHE_DIR:-$HOME/.cache/temper}
OUT=${1:-$CACHE/images/agent-bookworm.tar.gz}
PACKAGES=(openai)
if [[ -s $OUT ]]; then
  echo "agent_image: $OUT exists" >&2
  exit 0
fi
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -c requirements.lock -d "$WHEELS" "${PACKAGES[@]}"
echo "agent_image: $(ls "$WHEELS" | wc -l) wheels; building the image..." >&2
IFS=,; .venv/bin/temper images build-debian bookworm --wheels "$WHEELS" --install "${PACKAGES[*]}" --output "$OUT"
