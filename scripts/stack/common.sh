# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables here are used by the scripts that source this file
# Shared settings and helpers for scripts/stack/{up,down,status}.sh.
# Sourced, never run. Everything the stack writes lives under $STACK_DIR
# (<repo>/.stack); downloads and built binaries under $CACHE_DIR.

STACK_SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$STACK_SCRIPTS/../.." && pwd)"
STACK_DIR="$REPO_ROOT/.stack"
CACHE_DIR="${TEMPER_CACHE_DIR:-$REPO_ROOT/.cache}"

ALL_SERVERS=(postgres redis kafka s3)

# --- ports and credentials (docs/operations.md, "The local stack") ----------
HOST=127.0.0.1
PG_PORT=55432
PG_USER=temper
PG_PASSWORD=temper
PG_DB=temper
PG_OS_USER=postgres          # Postgres refuses to run as root
PG_BIN=/usr/lib/postgresql/15/bin

REDIS_PORT=56379

KAFKA_PORT=59092
KAFKA_CONTROLLER_PORT=59093
# 4.0.x: the line aiokafka 0.14.0 is known to work with (shared/FACTS.md).
KAFKA_VERSION="${KAFKA_VERSION:-4.0.2}"
KAFKA_HEAP="${KAFKA_HEAP:--Xms256m -Xmx512m}"

S3_PORT=59000
S3_ACCESS_KEY=temper
S3_SECRET_KEY=temper-secret-key
S3_BUCKET=temper
# MinIO is served by the Go module proxy only as a pseudo-version of its main
# branch (no tagged module versions); this one builds with Go 1.26 and has no
# replace directives, so `go install pkg@version` accepts it.
MINIO_MODULE=github.com/minio/minio
MINIO_VERSION="${MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}"

# How long each server may take to answer before up.sh gives up (seconds).
START_TIMEOUT="${TEMPER_STACK_TIMEOUT:-90}"

# --- output helpers ---------------------------------------------------------
log()  { printf '[stack] %s\n' "$*"; }
warn() { printf '[stack] WARNING: %s\n' "$*" >&2; }
die()  { printf '[stack] ERROR: %s\n' "$*" >&2; exit 1; }

now_ms() { date +%s%3N; }
fmt_secs() { # milliseconds -> "12.3s"
  local ms=$1
  printf '%d.%01ds' $((ms / 1000)) $(((ms % 1000) / 100))
}

# timed LABEL CMD...: run CMD, then print how long it took.
timed() {
  local label=$1; shift
  local t0; t0=$(now_ms)
  "$@"
  log "$label: done in $(fmt_secs $(($(now_ms) - t0)))"
}

# --- process helpers --------------------------------------------------------
pid_alive() { # pid: true while the process exists and is not a zombie
  [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null || return 1
  # A daemon that exited stays a zombie until its parent (often pid 1) reaps it.
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

pid_from_file() { # file -> prints pid (first line) or nothing
  local f=$1
  [[ -r "$f" ]] || return 0
  head -n1 "$f" | tr -dc '0-9'
}

port_open() { # port
  (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null
}

# wait_until NAME LOGFILE PID CHECK...: poll CHECK until it succeeds, the
# process PID dies, or START_TIMEOUT passes (then fail naming the log).
wait_until() {
  local name=$1 logfile=$2 pid=$3; shift 3
  local deadline=$((SECONDS + START_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if [[ -n "$pid" ]] && ! pid_alive "$pid"; then
      tail_log "$logfile"
      die "$name exited during start-up; see its log: $logfile"
    fi
    if ((SECONDS >= deadline)); then
      tail_log "$logfile"
      die "$name did not answer on $HOST within ${START_TIMEOUT}s; see its log: $logfile"
    fi
    sleep 0.3
  done
}

tail_log() {
  [[ -r "$1" ]] || return 0
  printf '[stack] ---- last lines of %s ----\n' "$1" >&2
  tail -n 25 "$1" >&2 || true
  printf '[stack] ----\n' >&2
}

# stop_pid NAME PID [GRACE_SECONDS]: SIGTERM, wait, then SIGKILL.
stop_pid() {
  local name=$1 pid=$2 grace=${3:-20}
  pid_alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + grace))
  while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
  if pid_alive "$pid"; then
    warn "$name (pid $pid) ignored SIGTERM for ${grace}s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
}

# apt_install PKG...: install Debian packages without starting their system
# services (we run our own instances on private ports).
apt_install() {
  local created_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    created_policy=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" || rc=$?
  if ((rc != 0)); then
    log "apt-get install failed; refreshing package lists and retrying"
    apt-get update -q || true
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" || rc=$?
  fi
  ((created_policy)) && rm -f /usr/sbin/policy-rc.d
  return "$rc"
}

# --- per-server locations ---------------------------------------------------
# .stack/postgres is normally a plain directory. When a parent of the repo is
# closed to the postgres OS user (a clone under /root, mode 0700), up.sh keeps
# the cluster in /var/lib/temper-stack/<hash>/postgres and makes .stack/postgres
# a link to it; PG_DIR is then the link's target, since the server itself
# cannot pass through the closed parent.
PG_LINK="$STACK_DIR/postgres"
pg_resolve_dirs() {
  PG_DIR="$PG_LINK"
  [[ -L $PG_LINK ]] && PG_DIR=$(readlink -m "$PG_LINK")
  PG_DATA="$PG_DIR/data"
  PG_SOCK="$PG_DIR/run"
  PG_LOG="$PG_DIR/postgres.log"
}
pg_resolve_dirs

REDIS_DIR="$STACK_DIR/redis"
REDIS_CONF="$REDIS_DIR/redis.conf"
REDIS_PID="$REDIS_DIR/redis.pid"
REDIS_LOG="$REDIS_DIR/redis.log"

KAFKA_DIR="$STACK_DIR/kafka"
KAFKA_HOME="$CACHE_DIR/kafka/$KAFKA_VERSION"   # libs/ resolved from Maven Central
KAFKA_PID="$KAFKA_DIR/kafka.pid"
KAFKA_LOG="$KAFKA_DIR/server.log"
KAFKA_OUT="$KAFKA_DIR/kafka.out"

S3_DIR="$STACK_DIR/s3"
S3_BIN="$CACHE_DIR/bin/minio-$MINIO_VERSION"
S3_PID="$S3_DIR/minio.pid"
S3_LOG="$S3_DIR/minio.log"

pg_pid()    { pid_from_file "$PG_DATA/postmaster.pid"; }
redis_pid() { pid_from_file "$REDIS_PID"; }
kafka_pid() { pid_from_file "$KAFKA_PID"; }
s3_pid()    { pid_from_file "$S3_PID"; }

server_port() {
  case $1 in
    postgres) echo "$PG_PORT" ;;
    redis) echo "$REDIS_PORT" ;;
    kafka) echo "$KAFKA_PORT" ;;
    s3) echo "$S3_PORT" ;;
  esac
}

server_pid() {
  case $1 in
    postgres) pg_pid ;;
    redis) redis_pid ;;
    kafka) kafka_pid ;;
    s3) s3_pid ;;
  esac
}

server_log() {
  case $1 in
    postgres) echo "$PG_LOG" ;;
    redis) echo "$REDIS_LOG" ;;
    kafka) echo "$KAFKA_LOG" ;;
    s3) echo "$S3_LOG" ;;
  esac
}

check_server_name() {
  case $1 in
    postgres|redis|kafka|s3) ;;
    minio) ;;  # accepted alias, mapped by callers
    *) die "unknown server '$1' (expected: ${ALL_SERVERS[*]})" ;;
  esac
}

# parse_servers ARGS...: sets SERVERS to the requested names (default: all).
parse_servers() {
  SERVERS=()
  local s
  for s in "$@"; do
    check_server_name "$s"
    [[ $s == minio ]] && s=s3
    SERVERS+=("$s")
  done
  ((${#SERVERS[@]})) || SERVERS=("${ALL_SERVERS[@]}")
}
