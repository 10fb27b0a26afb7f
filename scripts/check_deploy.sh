#!/usr/bin/env bash
# Offline validation of Temper's deployment artefacts (make check-deploy).
#   kustomize renders every overlay; each manifest validates against the Kubernetes schemas
#   shipped in kubernetes-validate (strict) or, for operator kinds, deploy/schemas/crds;
#   docker-compose.yml validates against the Compose specification schema shipped in
#   check-jsonschema; promtool checks the Prometheus config and rules and runs the alert tests;
#   every Temper process's environment (compose and each rendered overlay) loads as Settings
#   (deploy/tools/settings_check.py). When the cluster of `make k8s-up` runs, every overlay also
#   goes through its API server (a server-side dry run, CRDs installed from their operators).
# Installs its tools idempotently under ${TEMPER_CACHE_DIR:-<repo>/.cache} and .venv.
# Exits non-zero on any failure. `check_deploy.sh --tools` only installs the tools (make test
# does, so the tests that render overlays find kustomize on a fresh machine).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TEMPER_CACHE_DIR:-$ROOT/.cache}"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
GO="${GO:-/usr/local/go/bin/go}"
KUSTOMIZE_VERSION="v5.7.1"
KUSTOMIZE="$CACHE/bin/kustomize"
OUT="$CACHE/deploy-rendered"
cd "$ROOT"

# --- tools ------------------------------------------------------------------------------------
setup() {
  if [[ ! -x "$PY" ]]; then
    python3.11 -m venv "$VENV" || return 1
  fi
  # pinned in pyproject.toml's dev extra and the lock; scripts/setup.sh installs them
  if ! "$PY" -c "import kubernetes_validate, check_jsonschema" 2>/dev/null; then
    echo "kubernetes-validate or check-jsonschema missing from .venv: run make setup" >&2; return 1
  fi
  if ! command -v promtool >/dev/null; then
    if [[ $(id -u) -eq 0 ]]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
        >/dev/null || return 1
    else
      echo "promtool missing: sudo apt-get install -y prometheus" >&2; return 1
    fi
  fi
  if [[ ! -x "$KUSTOMIZE" ]] || [[ "$("$KUSTOMIZE" version 2>/dev/null)" != "$KUSTOMIZE_VERSION" ]]; then
    mkdir -p "$CACHE/bin"
    GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOBIN="$CACHE/bin" GOTOOLCHAIN=local GOFLAGS=-mod=mod \
      "$GO" install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION" || return 1
  fi
}

# --- steps ------------------------------------------------------------------------------------
declare -a RESULTS=()
FAILED=0
step() {  # step NAME COMMAND...
  local name="$1"; shift
  local log; log="$(mktemp)"
  if "$@" >"$log" 2>&1; then
    RESULTS+=("ok    $name")
  else
    RESULTS+=("FAIL  $name")
    FAILED=1
    echo "--- $name failed:"; sed 's/^/    /' "$log" | tail -n 40
  fi
  rm -f "$log"
}

render_and_validate() {  # render_and_validate DIR
  local dir="$1" file="$OUT/$(echo "$1" | tr / _).yaml"
  "$KUSTOMIZE" build "$dir" >"$file" || return 1
  "$PY" deploy/tools/deploycheck.py k8s "$file" || return 1
  "$PY" deploy/tools/deploycheck.py topics "$file" || return 1
  PYTHONPATH="$ROOT/libs:$ROOT" "$PY" deploy/tools/settings_check.py k8s "$file"
}

dashboard_json() {
  "$PY" - <<'PYEOF'
import json, yaml
dash = json.load(open("deploy/grafana/dashboards/temper.json"))
uid = yaml.safe_load(open("deploy/grafana/provisioning/datasources/prometheus.yml"))["datasources"][0]["uid"]
bad = [p["title"] for p in dash["panels"] if p["type"] != "row" and p["datasource"]["uid"] != uid]
assert not bad, f"panels not on datasource {uid}: {bad}"
assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "duplicate panel ids"
PYEOF
}

start=$(date +%s)
if [[ "${1:-}" == "--tools" ]]; then
  setup || { echo "check-deploy: installing the tools failed" >&2; exit 1; }
  exit 0
fi
step "tools (kustomize $KUSTOMIZE_VERSION, kubernetes-validate, check-jsonschema, promtool)" setup
if [[ $FAILED -ne 0 ]]; then
  printf '%s\n' "${RESULTS[@]}"; exit 1
fi
mkdir -p "$OUT"
for dir in k8s k8s/overlays/*/; do
  dir="${dir%/}"
  step "kustomize build + validate + Settings of $dir" render_and_validate "$dir"
done
step "k8s copies of rules and dashboard match deploy/" "$PY" deploy/tools/deploycheck.py check-sync
step "docker-compose.yml against the Compose specification" \
  "$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec docker-compose.yml
step "every Temper service's compose environment loads as Settings" \
  env PYTHONPATH="$ROOT/libs:$ROOT" "$PY" deploy/tools/settings_check.py compose docker-compose.yml
step "the same with deploy/compose/local-servers.yml (compose-test)" \
  env PYTHONPATH="$ROOT/libs:$ROOT" "$PY" deploy/tools/settings_check.py compose docker-compose.yml deploy/compose/local-servers.yml
step "promtool check config deploy/prometheus/prometheus.yml" promtool check config deploy/prometheus/prometheus.yml
step "promtool check rules deploy/prometheus/rules.yml" promtool check rules deploy/prometheus/rules.yml
step "promtool test rules deploy/prometheus/rules_test.yml" promtool test rules deploy/prometheus/rules_test.yml
step "every alert tested firing and quiet" "$PY" deploy/tools/deploycheck.py rule-tests
step "grafana dashboard JSON" dashboard_json
# With the one-node cluster of make k8s-up running: every overlay through the real API server.
K8S_KUBECONFIG="${TEMPER_K8S_DIR:-$ROOT/.k8s}/admin.kubeconfig"
if [[ -f "$K8S_KUBECONFIG" ]] && bash scripts/k8s/status.sh >/dev/null 2>&1 \
    && "$PY" scripts/k8s/k8s_test.py --help >/dev/null 2>&1; then
  overlays=(k8s); for dir in k8s/overlays/*/; do overlays+=("${dir%/}"); done
  step "every overlay accepted by the API server of make k8s-up (server-side dry run)" \
    "$PY" scripts/k8s/k8s_test.py --dry-run-only "${overlays[@]}"
fi

echo "check-deploy summary ($(( $(date +%s) - start ))s):"
printf '  %s\n' "${RESULTS[@]}"
if [[ $FAILED -ne 0 ]]; then
  echo "check-deploy: FAILED"; exit 1
fi
echo "check-deploy: all passed"
