#!/usr/bin/env bash
# Make the local Debian base image (no registry is reachable from these machines, so
# `FROM python:3.11-slim` cannot be pulled): debootstrap --variant=minbase bookworm, then
# `docker import`. Idempotent: an existing image is kept; the rootfs tarball is cached under
# ${TEMPER_CACHE_DIR:-<repo>/.cache}/docker so a fresh engine re-imports it in seconds.
#   scripts/compose/base_image.sh [NAME]     default: temper-base:bookworm
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NAME="${1:-temper-base:bookworm}"
CACHE="${TEMPER_CACHE_DIR:-$ROOT/.cache}/docker"
TAR="$CACHE/debian-bookworm-minbase.tar"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKER=/usr/bin/docker
log() { printf '[base-image] %s\n' "$*"; }

if $DOCKER image inspect "$NAME" >/dev/null 2>&1; then
  exit 0
fi
start=$(date +%s)
if [ ! -s "$TAR" ]; then
  dpkg-query -W -f='${Status}' debootstrap 2>/dev/null | grep -q "install ok installed" || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  mkdir -p "$CACHE"
  rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  log "debootstrap --variant=minbase bookworm ($MIRROR)"
  debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
  # Leave apt's lists out of the image: every Dockerfile runs apt-get update itself.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -cf "$TAR.part" . && mv "$TAR.part" "$TAR"
fi
$DOCKER import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' "$TAR" "$NAME" >/dev/null
log "$NAME made in $(( $(date +%s) - start ))s ($(du -h "$TAR" | cut -f1) rootfs)"
