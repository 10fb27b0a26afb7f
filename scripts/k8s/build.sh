#!/usr/bin/env bash
# Build the binaries of a one-node Kubernetes from the Go module proxy, once, into
# $K8S_BIN (cached like MinIO): kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy, kubectl, etcd, containerd 2 and runc, CoreDNS, local-path-provisioner,
# KEDA, MinIO's client
# and the static `pause` (`node`: what make k8s-up needs; `all`: make k8s-test's too).
# (The CNI plugins come from Debian's containernetworking-plugins.)
# Idempotent: a binary already built for the pinned release is kept.
#
# k8s.io/kubernetes' module zip drops its nested modules (staging/src/k8s.io/*) and
# vendor/, and `go install ...@version` refuses its replace directives; so the module is
# copied out, its `=> ./staging/...` replaces are pointed at the published k8s.io/*
# v0.X.Y modules (two sample modules that are not published are dropped), and it is
# built as the main module with -mod=mod.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
mkdir -p "$K8S_BIN"
export GOFLAGS=-mod=mod
export CGO_ENABLED=${CGO_ENABLED:-0}
JOBS=${TEMPER_K8S_BUILD_JOBS:-2}

have() { [ -x "$K8S_BIN/$1" ]; }
timed() { local label=$1; shift; local t0; t0=$(date +%s); "$@"; log "$label: built in $(( $(date +%s) - t0 ))s"; }

kube_src() {
  local src="$CACHE_DIR/k8s/src/kubernetes-$K8S_VERSION"
  if [ ! -f "$src/.prepared" ]; then
    log "kubernetes $K8S_VERSION: downloading the module from the Go module proxy"
    local dir
    dir=$(cd /tmp && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
    [ -d "$dir" ] || die "go mod download k8s.io/kubernetes@$K8S_VERSION gave no directory"
    rm -rf "$src"; mkdir -p "$(dirname "$src")"
    cp -r "$dir" "$src"; chmod -R u+w "$src"
    rm -rf "$src/vendor" "$src/go.work" "$src/go.work.sum"
    # ./staging replaces -> the published modules; the unpublished sample modules go.
    sed -i -E \
      -e '/k8s\.io\/sample-(cli-plugin|controller) => /d' \
      -e "s#^(\s*k8s\.io/[a-z0-9-]+) => \./staging/src/k8s\.io/[a-z0-9-]+\$#\1 => \1 $K8S_STAGING_VERSION#" \
      "$src/go.mod"
    sed -i -E '/^\s*k8s\.io\/sample-(cli-plugin|controller) v/d' "$src/go.mod"
    (cd "$src" && go mod tidy -e >/dev/null 2>&1 || true)
    touch "$src/.prepared"
  fi
  echo "$src"
}

kube_ldflags() {
  local v=${K8S_VERSION#v}; local major=${v%%.*}; local rest=${v#*.}; local minor=${rest%%.*}
  local now; now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local f=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    f+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$now -X $pkg.gitCommit=0000000000000000000000000000000000000000"
  done
  echo "-s -w$f"
}

build_kube() {
  local src; src=$(kube_src)
  local flags; flags=$(kube_ldflags)
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
    have "$cmd" && continue
    (cd "$src" && timed "$cmd" go build -p "$JOBS" -trimpath -ldflags "$flags" -o "$K8S_BIN/$cmd.tmp" "./cmd/$cmd")
    mv "$K8S_BIN/$cmd.tmp" "$K8S_BIN/$cmd"
  done
}

# etcd's server module has replace directives too: a small module that requires it builds it.
build_etcd() {
  have etcd && return 0
  local w="$CACHE_DIR/k8s/src/etcd-$ETCD_VERSION"
  mkdir -p "$w"
  cat > "$w/go.mod" <<MOD
module temper.local/etcdbuild

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
  cat > "$w/tools.go" <<'SRC'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3/etcdmain"
SRC
  (cd "$w" && go mod tidy >/dev/null && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null &&
    timed etcd go build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$K8S_BIN/etcd" go.etcd.io/etcd/server/v3)
}

build_coredns() {
  have coredns && return 0
  local w="$CACHE_DIR/k8s/src/coredns-$COREDNS_VERSION"
  mkdir -p "$w"
  printf 'module temper.local/corednsbuild\n\ngo 1.24\n\nrequire github.com/coredns/coredns %s\n' "$COREDNS_VERSION" > "$w/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/coredns/coredns/coremain"\n' > "$w/tools.go"
  (cd "$w" && go mod tidy >/dev/null && timed coredns go build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$K8S_BIN/coredns" github.com/coredns/coredns)
}

# The storage provisioner for PVCs: directories on the node.
build_local_path() {
  have local-path-provisioner && return 0
  local w="$CACHE_DIR/k8s/src/local-path-$LOCAL_PATH_VERSION"
  mkdir -p "$w"
  printf 'module temper.local/localpathbuild\n\ngo 1.24\n\nrequire github.com/rancher/local-path-provisioner %s\n' "$LOCAL_PATH_VERSION" > "$w/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/rancher/local-path-provisioner"\n' > "$w/tools.go"
  (cd "$w" && go mod tidy >/dev/null && timed local-path-provisioner go build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$K8S_BIN/local-path-provisioner" github.com/rancher/local-path-provisioner)
}

# KEDA's operator and metrics adapter (scaling on Kafka lag), built as the main module: its
# go.mod's replace directives point at published modules, which `go install` still refuses.
build_keda() {
  have keda-operator && have keda-adapter && return 0
  local src="$CACHE_DIR/k8s/src/keda-$KEDA_VERSION"
  if [ ! -f "$src/go.mod" ]; then
    local dir
    dir=$(cd /tmp && go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
    [ -d "$dir" ] || die "go mod download github.com/kedacore/keda/v2@$KEDA_VERSION gave no directory"
    rm -rf "$src"; mkdir -p "$(dirname "$src")"; cp -r "$dir" "$src"; chmod -R u+w "$src"
    rm -rf "$src/vendor"
  fi
  local ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
  for cmd in operator adapter; do
    have "keda-$cmd" && continue
    (cd "$src" && timed "keda-$cmd" go build -p "$JOBS" -trimpath -ldflags "$ldflags" -o "$K8S_BIN/keda-$cmd.tmp" "./cmd/$cmd")
    mv "$K8S_BIN/keda-$cmd.tmp" "$K8S_BIN/keda-$cmd"
  done
}

# The container runtime: containerd 2 and runc from the Go module proxy. Debian 12's
# containerd 1.6 and runc 1.1 cannot run a pod in its own user namespace (hostUsers: false,
# which the sandbox workers need for an unmasked /proc): the kubelet refuses the pod with
# "runtime does not support user namespaces". runc is built with seccomp (libseccomp-dev).
build_runtime() {
  have containerd && have containerd-shim-runc-v2 && have ctr && have runc && return 0
  (cd /tmp && CGO_ENABLED=1 GOBIN="$K8S_BIN" timed runc go install -tags seccomp -trimpath "github.com/opencontainers/runc@$RUNC_VERSION")
  (cd /tmp && CGO_ENABLED=1 GOBIN="$K8S_BIN" timed containerd go install -tags no_btrfs -trimpath \
    "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION")
}

# MinIO's client for the bucket Job k8s/base/deps/minio.yaml runs (minio/mc's interface).
build_mc() {
  have mc && return 0
  (cd /tmp && CGO_ENABLED=0 GOBIN="$K8S_BIN" timed mc go install -trimpath -ldflags "-s -w" "github.com/minio/mc@$MC_VERSION")
}

# The pod sandbox image's one binary, from Kubernetes' own source.
build_pause() {
  have pause && return 0
  local src; src=$(kube_src)
  gcc -Os -static -o "$K8S_BIN/pause" -DVERSION="$K8S_VERSION" "$src/build/pause/linux/pause.c"
  log "pause: built"
}

what=${1:-all}
case $what in
  node) build_pause; build_etcd; build_coredns; build_local_path; build_kube; build_runtime ;;
  all) build_pause; build_etcd; build_coredns; build_local_path; build_kube; build_runtime; build_keda; build_mc ;;
  runtime) build_runtime ;;
  mc) build_mc ;;
  keda) build_keda ;;
  kube) build_kube ;; etcd) build_etcd ;; local-path) build_local_path ;; coredns) build_coredns ;; pause) build_pause ;;
  *) die "unknown part $what (all node kube etcd coredns local-path runtime keda mc pause)" ;;
esac
log "binaries in $K8S_BIN: $(ls "$K8S_BIN" | tr '\n' ' ')"
