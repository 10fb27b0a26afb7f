#!/usr/bin/env bash
# Install (Debian's docker.io and docker-compose v1) and start the Docker engine.
# Idempotent: packages already installed are skipped; a running engine is left alone.
#   scripts/compose/engine.sh          install if missing, start if not running
#   scripts/compose/engine.sh stop     stop the engine this script started
# The daemon's log and pid live under <repo>/.docker (ignored by git).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="$ROOT/.docker"
log() { printf '[engine] %s\n' "$*"; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if [ "${1:-}" = "stop" ]; then
  pid=$(cat "$STATE/dockerd.pid" 2>/dev/null || true)
  [ -n "$pid" ] && $SUDO kill "$pid" 2>/dev/null && log "stopped dockerd ($pid)"
  exit 0
fi

missing=()
for pkg in docker.io docker-compose; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's docker CLI; another `docker` earlier on PATH (a static client) may not match the engine.
DOCKER=/usr/bin/docker
if $DOCKER info >/dev/null 2>&1; then
  exit 0
fi
mkdir -p "$STATE"
# No systemd in these machines: start dockerd ourselves, detached, and wait for its socket.
log "starting dockerd (log: $STATE/dockerd.log)"
$SUDO setsid /usr/sbin/dockerd --pidfile "$STATE/dockerd.pid" >"$STATE/dockerd.log" 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if $DOCKER info >/dev/null 2>&1; then
    log "dockerd ready: $($DOCKER info --format '{{.ServerVersion}} {{.Driver}} cgroup v{{.CgroupVersion}}')"
    exit 0
  fi
  sleep 1
done
tail -n 30 "$STATE/dockerd.log" >&2
log "dockerd did not start in 60s" >&2
exit 1
