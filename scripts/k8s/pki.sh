#!/usr/bin/env bash
# The cluster's certificates and kubeconfigs under $K8S_DIR/pki, made once with openssl:
# a cluster CA (API server, clients, kubelet), a front-proxy CA (aggregated APIs such as
# KEDA's external metrics read the requestheader client), the service-account key pair.
# Idempotent: files that exist are kept.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
P="$K8S_DIR/pki"
mkdir -p "$P"; chmod 700 "$P"
NODE_IP=$(node_ip)

ca() {  # ca NAME CN
  [ -f "$P/$1.crt" ] && return 0
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=$2" \
    -keyout "$P/$1.key" -out "$P/$1.crt" 2>/dev/null
}

cert() {  # cert NAME CA SUBJECT USAGE [SANS]
  local name=$1 caname=$2 subj=$3 usage=$4 sans=${5:-}
  [ -f "$P/$name.crt" ] && return 0
  local ext="$P/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -n "$sans" ] && echo "subjectAltName=$sans"
  } > "$ext"
  openssl req -newkey rsa:2048 -nodes -subj "$subj" -keyout "$P/$name.key" -out "$P/$name.csr" 2>/dev/null
  openssl x509 -req -in "$P/$name.csr" -CA "$P/$caname.crt" -CAkey "$P/$caname.key" -CAcreateserial \
    -days 3650 -extfile "$ext" -out "$P/$name.crt" 2>/dev/null
  rm -f "$P/$name.csr" "$ext"
}

kubeconfig() {  # kubeconfig NAME USER SERVER
  local name=$1 user=$2 server=$3
  [ -f "$K8S_DIR/$name.kubeconfig" ] && return 0
  cat > "$K8S_DIR/$name.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: temper
  cluster:
    certificate-authority-data: $(base64 -w0 < "$P/ca.crt")
    server: $server
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 < "$P/$name.crt")
    client-key-data: $(base64 -w0 < "$P/$name.key")
contexts:
- name: temper
  context: {cluster: temper, user: $user}
current-context: temper
KC
  chmod 600 "$K8S_DIR/$name.kubeconfig"
}

ca ca temper-k8s-ca
ca front-proxy-ca temper-k8s-front-proxy-ca
[ -f "$P/sa.key" ] || { openssl genrsa -out "$P/sa.key" 2048 2>/dev/null; openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null; }

# The API server answers on the node's address (pods reach it there), on 127.0.0.1 and on
# the first address of the service range (the `kubernetes` Service).
cert apiserver ca "/CN=kube-apiserver" serverAuth \
  "IP:$NODE_IP,IP:127.0.0.1,IP:$SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
cert apiserver-kubelet-client ca "/O=kubeadm:cluster-admins/CN=kube-apiserver-kubelet-client" clientAuth
cert front-proxy-client front-proxy-ca "/CN=front-proxy-client" clientAuth
cert admin ca "/O=system:masters/CN=kubernetes-admin" clientAuth
cert controller-manager ca "/CN=system:kube-controller-manager" clientAuth
cert scheduler ca "/CN=system:kube-scheduler" clientAuth
cert kube-proxy ca "/CN=system:kube-proxy" clientAuth
cert kubelet ca "/O=system:nodes/CN=system:node:$NODE_NAME" clientAuth
cert kubelet-serving ca "/CN=$NODE_NAME" serverAuth "IP:$NODE_IP,IP:127.0.0.1,DNS:$NODE_NAME"

server="https://$NODE_IP:$APISERVER_PORT"
kubeconfig admin kubernetes-admin "$server"
kubeconfig controller-manager system:kube-controller-manager "$server"
kubeconfig scheduler system:kube-scheduler "$server"
kubeconfig kube-proxy system:kube-proxy "$server"
kubeconfig kubelet "system:node:$NODE_NAME" "$server"
log "pki: certificates and kubeconfigs in $K8S_DIR"
