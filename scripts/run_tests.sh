#!/usr/bin/env bash
# The whole test suite against the real stack (`make stack-up` must have run).
# Fails when pytest collects nothing (exit 5) or when no integration test against a
# real Kafka, Postgres, S3 or Redis passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export TEMPER_REQUIRE_INTEGRATION=1
# tests/conftest.py reads the servers' addresses from .stack/env itself.
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure of ours" >&2
  exit 1
fi
exit "$status"
