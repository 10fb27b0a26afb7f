#!/usr/bin/env bash
# The whole test suite against the real stack (`make stack-up` must have run).
# Fails when pytest collects nothing (exit 5) or when no integration test against a
# real Kafka, Postgres, S3 or Redis passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export TEMPER_REQUIRE_INTEGRATION=1
# tests/conftest.py reads the servers' addresses from .stack/env itself.
# Deselected, never skipped: tests marked long (fault and load runs that a shorter test of
# the suite covers in part; `make test-long` runs them), GPU tests where no CUDA device is
# visible, Docker-engine tests where `docker info` fails (scripts/compose/engine.sh starts one).
skip=(long)
if ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  skip+=(gpu)
fi
if ! docker info >/dev/null 2>&1; then
  echo "run_tests: no Docker engine reachable: deselecting tests marked docker" >&2
  skip+=(docker)
fi
filter="not ${skip[0]}"
for marker in "${skip[@]:1}"; do filter+=" and not $marker"; done
# --durations: the slowest tests in every log, to keep CI well under its budget
.venv/bin/python -m pytest -m "$filter" --durations=25 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure of ours" >&2
  exit 1
fi
exit "$status"
