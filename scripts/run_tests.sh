#!/usr/bin/env bash
# The whole test suite against the real stack (`make stack-up` must have run).
# Fails when pytest collects nothing (exit 5) or when no integration test against a
# real Kafka, Postgres, S3 or Redis passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export TEMPER_REQUIRE_INTEGRATION=1
# tests/conftest.py reads the servers' addresses from .stack/env itself.
# GPU tests run only where a CUDA device is visible (they are deselected, never skipped).
gpu_filter=(-m "not gpu")
if .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  gpu_filter=()
fi
# Docker-engine tests (images from a Dockerfile) likewise: deselected, and said so, where
# `docker info` fails (scripts/compose/engine.sh starts an engine).
if ! docker info >/dev/null 2>&1; then
  echo "run_tests: no Docker engine reachable: deselecting tests marked docker" >&2
  if [ "${#gpu_filter[@]}" -gt 0 ]; then gpu_filter=(-m "not gpu and not docker"); else gpu_filter=(-m "not docker"); fi
fi
# --durations: the slowest tests in every log, to keep CI well under its budget
.venv/bin/python -m pytest "${gpu_filter[@]}" --durations=25 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure of ours" >&2
  exit 1
fi
exit "$status"
