#!/usr/bin/env bash
# `make run-stack`: the example job on the local stack, each service its own process.
#   bash scripts/run_processes.sh SPEC [--iterations N] [--episodes N] [--warm-start-steps N] ...
# Needs the stack (`make stack-up`); see `python -m services.launcher --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
if [[ ! -f .stack/env && -z "${TEMPER_DB__URL:-}" ]]; then
  echo "run_processes: no .stack/env; start the stack first: make stack-up" >&2
  exit 2
fi
exec "$PY" -m services.launcher "$@"
