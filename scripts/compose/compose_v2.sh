#!/usr/bin/env bash
# Build Docker Compose v2 from the Go module proxy (as scripts/stack builds MinIO) and print
# the binary's path. Debian bookworm packages only compose v1 (1.29), which cannot run
# docker-compose.yml: v1 hands `security_opt: systempaths=unconfined` (the sandbox
# containers need it, docs/compose.md) to the engine, which refuses it; v2 applies it.
# Idempotent: an existing binary is reused. Takes about 6.5 minutes cold on 2 cores.
#   scripts/compose/compose_v2.sh      -> prints e.g. <cache>/bin/compose-v2.29.7/cmd
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TEMPER_CACHE_DIR:-$ROOT/.cache}"
GO="${GO:-/usr/local/go/bin/go}"
VERSION="${COMPOSE_VERSION:-v2.29.7}"  # the newest line that still talks to Debian's engine 20.10 (API 1.41)
BIN="$CACHE/bin/compose-$VERSION/cmd"
if [ ! -x "$BIN" ]; then
  mkdir -p "$CACHE/go"
  echo "[compose-v2] go install github.com/docker/compose/v2/cmd@$VERSION" >&2
  GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOBIN="$(dirname "$BIN")" GOTOOLCHAIN=local \
    GOFLAGS=-mod=mod "$GO" install "github.com/docker/compose/v2/cmd@$VERSION" >&2
fi
echo "$BIN"
