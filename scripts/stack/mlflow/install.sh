#!/usr/bin/env bash
# Install the MLflow tracking server the tests marked mlflow log to: mlflow 3.18.0 from PyPI in
# an environment of its own under $TEMPER_CACHE_DIR/mlflow/, exactly the wheels and hashes of
# requirements.txt (`pip install --require-hashes --no-deps`; lock.py writes it and says why
# mlflow-tracing is not among them). Temper itself talks to the server over its REST API and
# has no mlflow package.
#
#   scripts/stack/mlflow/install.sh                 # `make stack-up` calls it
#   scripts/stack/mlflow/install.sh --print-python  # then prints the environment's python
#
# Idempotent: a complete environment (its stamp written last) is left alone. A changed
# requirements.txt makes a new environment (named by its hash) and removes the old ones. The
# server is started by the tests that need one (tests/services/tracker/mlflow_server.py), each
# on its own port and database, so a test may stop and restart its own.
set -euo pipefail
# shellcheck source=scripts/stack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

HERE="$STACK_SCRIPTS/mlflow"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
MLFLOW_ROOT="$CACHE_DIR/mlflow"
KEY=$(sha256sum "$HERE/requirements.txt" | cut -c1-16)
ENV_DIR="$MLFLOW_ROOT/env-$KEY"
STAMP="$ENV_DIR/.temper-complete"

installed() { [[ -f $STAMP && $(cat "$STAMP") == "$KEY" && -x $ENV_DIR/bin/mlflow ]]; }

install_env() {
  log "mlflow: installing mlflow 3.18.0 into $ENV_DIR ($(grep -c -- '--hash=' "$HERE/requirements.txt") hashed wheels)"
  rm -rf "$ENV_DIR"
  "$PYTHON" -m venv "$ENV_DIR"
  local piplog="$MLFLOW_ROOT/pip-$KEY.log"
  "$ENV_DIR/bin/python" -m pip --quiet --disable-pip-version-check install --require-hashes --no-deps \
    --only-binary :all: -r "$HERE/requirements.txt" >"$piplog" 2>&1 \
    || { tail_log "$piplog"; die "mlflow: pip install failed; see $piplog"; }
  # The server's code imports and is the version we pinned; the stamp comes last.
  "$ENV_DIR/bin/python" -c 'import mlflow, mlflow.server; assert mlflow.__version__ == "3.18.0", mlflow.__version__' \
    >>"$piplog" 2>&1 || { tail_log "$piplog"; die "mlflow: 'import mlflow.server' failed in $ENV_DIR; see $piplog"; }
  echo "$KEY" >"$STAMP"
  local old
  for old in "$MLFLOW_ROOT"/env-*; do
    [[ $old == "$ENV_DIR" || ! -d $old ]] || { log "mlflow: removing the old environment $old"; rm -rf "$old"; }
  done
}

mkdir -p "$MLFLOW_ROOT"
# One installer at a time (a CI run and `make stack-up` in another checkout share the cache).
exec 9>"$MLFLOW_ROOT/.lock"
flock 9
t0=$(now_ms)
if installed; then
  log "mlflow: mlflow 3.18.0 installed ($ENV_DIR)"
else
  install_env
  log "mlflow: installed in $(fmt_secs $(($(now_ms) - t0)))"
fi
if [[ ${1:-} == --print-python ]]; then echo "$ENV_DIR/bin/python"; fi
