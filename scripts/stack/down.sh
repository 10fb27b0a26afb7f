#!/usr/bin/env bash
# Stop the local stack started by scripts/stack/up.sh.
#
#   scripts/stack/down.sh                # stop all servers, keep their data
#   scripts/stack/down.sh kafka          # stop only these
#   scripts/stack/down.sh --wipe [...]   # stop, then delete their data and logs
#
# Each server gets a graceful stop (SIGTERM / pg_ctl fast shutdown), then SIGKILL
# if it has not exited in time. The download/build cache is never touched.
set -euo pipefail
# shellcheck source=scripts/stack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

WIPE=0
args=()
for a in "$@"; do
  case $a in
    --wipe) WIPE=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
parse_servers "${args[@]+"${args[@]}"}"

stop_postgres() {
  local pid; pid=$(pg_pid)
  pid_alive "$pid" || return 0
  if [[ -x $PG_BIN/pg_ctl ]]; then
    if [[ $EUID -eq 0 ]]; then
      (cd / && runuser -u "$PG_OS_USER" -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -t 30 -s stop) || true
    else
      "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -t 30 -s stop || true
    fi
  fi
  stop_pid postgres "$pid" 10
}

stop_redis() {
  local pid; pid=$(redis_pid)
  pid_alive "$pid" || return 0
  stop_pid redis "$pid" 10
}

stop_kafka() {
  local pid; pid=$(kafka_pid)
  pid_alive "$pid" || return 0
  stop_pid kafka "$pid" 30    # SIGTERM runs Kafka's controlled shutdown
}

stop_s3() {
  local pid; pid=$(s3_pid)
  pid_alive "$pid" || return 0
  stop_pid s3 "$pid" 10
}

server_dir() {
  case $1 in
    postgres) echo "$PG_DIR" ;;
    redis) echo "$REDIS_DIR" ;;
    kafka) echo "$KAFKA_DIR" ;;
    s3) echo "$S3_DIR" ;;
  esac
}

# Stop in reverse start order.
for ((i = ${#SERVERS[@]} - 1; i >= 0; i--)); do
  s=${SERVERS[i]}
  pid=$(server_pid "$s")
  t0=$(now_ms)
  if pid_alive "$pid"; then
    "stop_$s"
    log "$s: stopped (was pid $pid) in $(fmt_secs $(($(now_ms) - t0)))"
  else
    log "$s: not running"
  fi
  if ((WIPE)); then
    rm -rf "$(server_dir "$s")"
    if [[ $s == postgres && -L $PG_LINK ]]; then
      rm -f "$PG_LINK"
      rmdir --ignore-fail-on-non-empty "$(dirname "$PG_DIR")" /var/lib/temper-stack 2>/dev/null || true
    fi
    log "$s: data and logs wiped ($(server_dir "$s"))"
  fi
done
if ((WIPE)) && ((${#SERVERS[@]} == ${#ALL_SERVERS[@]})); then
  rm -f "$STACK_DIR/env"
fi
