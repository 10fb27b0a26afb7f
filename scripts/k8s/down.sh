#!/usr/bin/env bash
# make k8s-down: stop the one-node cluster and remove its state ($K8S_DIR, its mounts, the
# pod bridge, kube-proxy's iptables rules). The built binaries and images stay cached.
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
[ -d "$K8S_DIR" ] || log "down: no cluster state under $K8S_DIR; cleaning what may be left"

stop() {
  local name=$1 pidf="$K8S_DIR/run/$1.pid"
  [ -f "$pidf" ] || return 0
  local pid; pid=$(cat "$pidf")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$pidf"
}

stop kube-proxy
stop kubelet
# Every container of this containerd: its shims (and the containers under them) go first.
pkill -9 -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null
stop containerd
stop kube-scheduler
stop kube-controller-manager
stop kube-apiserver
stop etcd
[ -x "$K8S_BIN/kube-proxy" ] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1
# Mounts the kubelet and containerd left (volumes, rootfs, shm), deepest first.
awk -v a="$K8S_DIR" -v b=/run/temper-k8s '$2 ~ "^"a || $2 ~ "^"b {print $2}' /proc/mounts | sort -r | while read -r m; do
  umount -l "$m" 2>/dev/null
done
ip link del cni0 2>/dev/null
# The bridge plugin's NAT chains (ipMasq), one per pod that was not torn down by its plugin.
iptables -t nat -L POSTROUTING -n --line-numbers 2>/dev/null | awk '$2 ~ /^CNI-/ {print $1}' | sort -rn |
  while read -r n; do iptables -t nat -D POSTROUTING "$n"; done
for chain in $(iptables -t nat -S 2>/dev/null | awk '/^-N CNI-/{print $2}'); do
  iptables -t nat -F "$chain" 2>/dev/null; iptables -t nat -X "$chain" 2>/dev/null
done
rm -rf "$K8S_DIR" /run/temper-k8s
log "down: cluster stopped and $K8S_DIR removed"
