#!/usr/bin/env bash
# The whole test suite against the real stack (`make stack-up` must have run).
# Fails when pytest collects nothing (exit 5) or when no integration test against a
# real Kafka, Postgres, S3, Redis or vLLM passed.
#
# TEMPER_TEST_LANES=2 (and no arguments) runs two lanes at once (the machines here have
# 2 cores, and the slow tests mostly wait on their services): the tests on the shared Kafka, S3 or Redis,
# one at a time in one pytest (some use the stack's default topics and consumer groups),
# and the rest (SQLite, a throwaway Postgres database each, sandboxes, torch) in another.
# The first lane is shown as it runs, the second when it ends; the second runs at nice 10,
# so the services the first lane's tests start and wait on get the CPU when both want it. With arguments (a path,
# `-m long`, `-k ...`), or by default, it is one pytest run: in the one fresh-clone run with
# two lanes a sandbox test hung in a session's teardown (tests/libs/sandbox/test_sandbox.py::
# test_idle_sessions_expire), not yet understood, so two lanes are opt-in until it is.
set -uo pipefail
cd "$(dirname "$0")/.."
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

# pytest's exit code, with "collected nothing" (5) made a failure of ours
checked() {
  local status=$1 what=$2
  if [ "$status" -eq 5 ]; then
    echo "run_tests: pytest collected no tests ($what); that is a failure of ours" >&2
    return 1
  fi
  return "$status"
}

# --durations: the slowest tests in every log, to keep CI well under its budget
if [ "$#" -gt 0 ] || [ "${TEMPER_TEST_LANES:-1}" != 2 ]; then
  TEMPER_REQUIRE_INTEGRATION=1 .venv/bin/python -m pytest -m "$filter" --durations=25 "$@"
  checked $? "all"
  exit $?
fi

shared="kafka or s3 or redis or vllm or mlflow"  # vllm, mlflow: servers started by fixtures
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$(date +%s)
# each lane its own basetemp: a pytest run prunes the numbered ones it did not make
(
  env -u TEMPER_REQUIRE_INTEGRATION nice -n 10 .venv/bin/python -m pytest -m "($filter) and not ($shared)" --durations=15 -p no:cacheprovider \
    --basetemp="$logs/tmp-local" >"$logs/local.log" 2>&1
  echo $? >"$logs/local.rc"
) &
local_pid=$!
# the shared lane needs a passing test against each real server (Postgres included)
TEMPER_REQUIRE_INTEGRATION=1 .venv/bin/python -m pytest -m "($filter) and ($shared)" --durations=15 \
  -p no:cacheprovider --basetemp="$logs/tmp-shared"
checked $? "the shared-stack lane"
shared_status=$?
echo "run_tests: the shared-stack lane ended after $(( $(date +%s) - start ))s; waiting for the other lane" >&2
wait "$local_pid"
echo "==================== the other lane: no shared Kafka, S3 or Redis ===================="
cat "$logs/local.log"
checked "$(cat "$logs/local.rc")" "the local lane"
local_status=$?
echo "run_tests: both lanes ended after $(( $(date +%s) - start ))s (shared: exit $shared_status, local: exit $local_status)" >&2
[ "$shared_status" -eq 0 ] && [ "$local_status" -eq 0 ]
