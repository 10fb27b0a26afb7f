#!/usr/bin/env bash
# Build every image compose-test runs: the Temper image (Dockerfile, BASE_IMAGE = the local
# Debian base) and the local servers (deploy/compose/servers.Dockerfile). Starts the engine
# and makes the base image and the wheelhouse first when they are missing. Prints each
# step's time. Idempotent: Docker's layer cache makes an unchanged rebuild take seconds.
#   scripts/compose/build.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
CACHE="${TEMPER_CACHE_DIR:-$ROOT/.cache}"
BASE="${TEMPER_BASE_IMAGE:-temper-base:bookworm}"
KAFKA_VERSION="${KAFKA_VERSION:-4.0.2}"
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1
log() { printf '[build] %s\n' "$*"; }
timed() { local t0=$SECONDS; "${@:2}"; log "$1: $((SECONDS - t0))s"; }

timed "engine" bash scripts/compose/engine.sh
timed "compose v2" bash -c 'bash scripts/compose/compose_v2.sh >/dev/null'
timed "base image $BASE" bash scripts/compose/base_image.sh "$BASE"
timed "wheelhouse" bash scripts/compose/wheelhouse.sh

# The servers' binaries: what scripts/stack/up.sh built (Kafka's jars, MinIO from source).
stage_servers() {
  local minio kafka="$CACHE/kafka/$KAFKA_VERSION/libs"
  minio=$(ls -t "$CACHE"/bin/minio-* 2>/dev/null | head -n1 || true)
  if [[ ! -d $kafka || -z $minio ]]; then
    log "Kafka's jars or MinIO missing under $CACHE: run scripts/stack/up.sh once (it builds them)"
    return 1
  fi
  mkdir -p .docker/servers/kafka
  rm -rf .docker/servers/kafka/libs
  cp -a "$kafka" .docker/servers/kafka/libs
  cmp -s "$minio" .docker/servers/minio || cp "$minio" .docker/servers/minio
}
timed "stage Kafka and MinIO" stage_servers

build() {  # build TAG [docker build args...]
  local tag=$1; shift
  $DOCKER build -q --build-arg "BASE_IMAGE=$BASE" -t "$tag" "$@" . >/dev/null
}
timed "image temper:local" build temper:local -f Dockerfile
for target in postgres redis kafka minio prometheus; do
  timed "image temper-$target:local" build "temper-$target:local" -f deploy/compose/servers.Dockerfile --target "$target"
done
$DOCKER image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^temper' | sed 's/^/[build]   /'
