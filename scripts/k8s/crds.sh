#!/usr/bin/env bash
# The custom resource definitions k8s/ uses, each from its operator's own published source,
# written to $K8S_CACHE/crds/ (cached) and printed as one stream for `kubectl apply -f -`:
#   keda.sh                 KEDA's config/crd/bases, from its Go module (the proxy)
#   monitoring.coreos.com   the Prometheus operator's example/prometheus-operator-crd, likewise
#   kafka.strimzi.io        Strimzi's CrdGenerator (Maven Central's io.strimzi:crd-generator)
#                           run on its published io.strimzi:api model classes, as Strimzi's
#                           build makes the CRDs it ships
#   postgresql.cnpg.io      CloudNativePG is on neither registry: the CRD is Temper's own,
#                           made from deploy/schemas/crds/postgresql.cnpg.io_v1.yaml (the
#                           fields Temper uses, typed; others pruned), labelled so
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
PROM_OPERATOR_VERSION=${PROM_OPERATOR_VERSION:-v0.85.0}
# 0.45 is the newest Strimzi whose crd-generator is on Maven Central; it serves v1beta2
# Kafka, KafkaNodePool and KafkaTopic, what k8s/base/deps uses.
STRIMZI_VERSION=${STRIMZI_VERSION:-0.45.0}
MAVEN=https://repo1.maven.org/maven2
OUT="$K8S_CACHE/crds"
mkdir -p "$OUT"

module_dir() { (cd /tmp && go mod download -json "$1" | sed -n 's/.*"Dir": "\(.*\)",/\1/p'); }

keda() {
  [ -f "$OUT/keda.yaml" ] && return 0
  local dir; dir=$(module_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
  for f in "$dir"/config/crd/bases/*.yaml; do cat "$f"; echo "---"; done > "$OUT/keda.yaml"
}

prometheus_operator() {
  [ -f "$OUT/monitoring.yaml" ] && return 0
  local dir; dir=$(module_dir "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION")
  for kind in servicemonitors podmonitors prometheusrules; do
    cat "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml"; echo "---"
  done > "$OUT/monitoring.yaml"
}

maven_jar() {  # maven_jar GROUP_PATH ARTIFACT VERSION -> path (sha1 checked against Maven Central's)
  local path="$OUT/jars/$2-$3.jar" url="$MAVEN/$1/$2/$3/$2-$3.jar"
  mkdir -p "$OUT/jars"
  if [ ! -f "$path" ]; then
    curl -sfL -o "$path.tmp" "$url" || die "cannot download $url"
    local want; want=$(curl -sfL "$url.sha1" | cut -c1-40)
    [ "$(sha1sum "$path.tmp" | cut -c1-40)" = "$want" ] || die "$url: sha1 differs from Maven Central's"
    mv "$path.tmp" "$path"
  fi
  echo "$path"
}

strimzi() {
  [ -f "$OUT/strimzi.yaml" ] && return 0
  command -v java >/dev/null || die "java is needed to run Strimzi's CRD generator"
  local gen api
  gen=$(maven_jar io/strimzi crd-generator "$STRIMZI_VERSION")
  api=$(maven_jar io/strimzi api "$STRIMZI_VERSION")
  local tmp; tmp=$(mktemp -d)
  for kind in kafka.Kafka nodepool.KafkaNodePool topic.KafkaTopic; do
    java -cp "$gen:$api" io.strimzi.crdgenerator.CrdGenerator --yaml --api-versions v1beta2 \
      --storage-version v1beta2 --crd-api-version v1 --target-kube 1.16+ \
      "io.strimzi.api.kafka.model.$kind=$tmp/${kind##*.}.yaml" >/dev/null 2>&1 || die "Strimzi's CrdGenerator failed for $kind"
  done
  for f in "$tmp"/*.yaml; do cat "$f"; echo "---"; done > "$OUT/strimzi.yaml"
  rm -rf "$tmp"
}

cnpg() {
  "$REPO_ROOT/.venv/bin/python" "$K8S_SCRIPTS/cnpg_crd.py" "$REPO_ROOT/deploy/schemas/crds/postgresql.cnpg.io_v1.yaml" > "$OUT/cnpg.yaml"
}

keda; prometheus_operator; strimzi; cnpg
cat "$OUT/keda.yaml" "$OUT/monitoring.yaml" "$OUT/strimzi.yaml" "$OUT/cnpg.yaml"
