#!/usr/bin/env bash
# make k8s-status: the cluster's processes, the node, and every pod.
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
for name in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy; do
  pidf="$K8S_DIR/run/$name.pid"
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then state="running (pid $(cat "$pidf"))"; else state=stopped; fi
  printf '%-24s %s\n' "$name" "$state"
done
[ -f "$K8S_DIR/admin.kubeconfig" ] || exit 0
kubectl_ get nodes -o wide 2>&1
kubectl_ get pods -A -o wide 2>&1
