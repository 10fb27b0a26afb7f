# shellcheck shell=bash
# shellcheck disable=SC2034  # used by the scripts that source this file
# Shared settings for scripts/k8s/*.sh: a one-node Kubernetes built here from the Go
# module proxy and Debian's packages (docs/operations.md, "Kubernetes on one machine").
# Sourced, never run. Binaries are cached under $K8S_CACHE; the cluster's state (certs,
# etcd data, kubelet dirs, logs) lives under $K8S_DIR.

K8S_SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$K8S_SCRIPTS/../.." && pwd)"
CACHE_DIR="${TEMPER_CACHE_DIR:-$REPO_ROOT/.cache}"

# Pinned releases. Kubernetes 1.34 still runs on cgroup v1 (1.35 refuses it by default).
K8S_VERSION="${K8S_VERSION:-v1.34.4}"
K8S_STAGING_VERSION="v0.${K8S_VERSION#v1.}"          # k8s.io/api etc. are tagged v0.34.x
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.4.2}"
RUNC_VERSION="${RUNC_VERSION:-v1.5.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.12.4}"
KEDA_VERSION="${KEDA_VERSION:-v2.18.1}"   # supports Kubernetes 1.32-1.34
LOCAL_PATH_VERSION="${LOCAL_PATH_VERSION:-v0.0.30}"
# MinIO publishes its client only as pseudo-versions of its main branch (as the server).
MC_VERSION="${MC_VERSION:-v0.0.0-20250313080218-cf909e1063a9}"

K8S_CACHE="$CACHE_DIR/k8s/$K8S_VERSION"
K8S_BIN="$K8S_CACHE/bin"
K8S_DIR="${TEMPER_K8S_DIR:-$REPO_ROOT/.k8s}"

log()  { printf '[k8s] %s\n' "$*" >&2; }
warn() { printf '[k8s] WARNING: %s\n' "$*" >&2; }
die()  { printf '[k8s] ERROR: %s\n' "$*" >&2; exit 1; }

# The node: named `localhost` (the kubelet refuses --node-ip=127.0.0.1; the API server
# reaches the kubelet by hostname), advertised on the machine's own address so pods
# can reach the API server (not 127.0.0.1).
NODE_NAME=localhost
APISERVER_PORT=6443
ETCD_PORT=2379
SERVICE_CIDR=10.96.0.0/16
SERVICE_IP=10.96.0.1
DNS_IP=10.96.0.10
POD_CIDR=10.244.0.0/24
CONTAINERD_SOCK=/run/temper-k8s/containerd.sock
node_ip() {
  local ip
  ip=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n1)
  [ -n "$ip" ] || ip=$(hostname -I | awk '{print $1}')
  [ -n "$ip" ] || die "no IPv4 address other than loopback: the API server needs one that pods can reach"
  echo "$ip"
}
kubectl_() { "$K8S_BIN/kubectl" --kubeconfig "$K8S_DIR/admin.kubeconfig" "$@"; }
PAUSE_IMAGE=registry.k8s.io/pause:3.10
ctr_() { "$K8S_BIN/ctr" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
# Images the cluster runs, all built here (scripts/k8s/images.sh) and never pulled.
COREDNS_IMAGE=temper.local/coredns:${COREDNS_VERSION#v}
LOCAL_PATH_IMAGE=temper.local/local-path-provisioner:$LOCAL_PATH_VERSION
BUSYBOX_IMAGE=temper.local/busybox:debian
TEMPER_IMAGE=temper.local/temper:dev
REDIS_IMAGE=temper.local/redis:7
MINIO_IMAGE=temper.local/minio:local
KAFKA_IMAGE=temper.local/kafka:4.0
POSTGRES_IMAGE=temper.local/postgres:15
MC_IMAGE=temper.local/mc:local
KEDA_IMAGE=temper.local/keda:${KEDA_VERSION#v}
KEDA_ADAPTER_IMAGE=temper.local/keda-metrics-apiserver:${KEDA_VERSION#v}
