#!/usr/bin/env bash
# One line per server of the local stack: running/stopped, port, pid.
# Exits non-zero if any requested server (default: all) is not running.
#
#   scripts/stack/status.sh [postgres|redis|kafka|s3 ...]
#
# "running" means the process is alive and its port accepts connections on
# 127.0.0.1 (up.sh does the deeper protocol-level checks).
set -euo pipefail
# shellcheck source=scripts/stack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_servers "$@"
down=0
for s in "${SERVERS[@]}"; do
  port=$(server_port "$s")
  pid=$(server_pid "$s")
  if pid_alive "$pid" && port_open "$port"; then
    state=running
  elif pid_alive "$pid"; then
    state="starting?"   # alive, port not open (yet)
    down=1
  else
    state=stopped
    pid=-
    down=1
  fi
  printf '%-9s %-9s %s:%-6s pid %-8s log %s\n' "$s" "$state" "$HOST" "$port" "${pid:--}" "$(server_log "$s")"
done
exit "$down"
