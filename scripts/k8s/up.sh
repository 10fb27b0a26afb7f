#!/usr/bin/env bash
# make k8s-up: a one-node Kubernetes on this machine, idempotently.
#   1. Debian packages: the CNI plugins, iptables, conntrack, busybox (the helper image),
#      libseccomp (runc's seccomp).
#   2. The binaries (build.sh, cached), the certificates (pki.sh).
#   3. etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd (its own
#      socket, so a Docker engine's containerd is left alone), kubelet and kube-proxy, each
#      detached with its log and pid under $K8S_DIR.
#   4. The local images the node needs (pause, CoreDNS, the storage provisioner's), then
#      CoreDNS and local-path-provisioner as cluster add-ons; waits for the node to be Ready.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
t_start=$(date +%s)
[ "$(id -u)" = 0 ] || die "the kubelet and containerd need root"
mkdir -p "$K8S_DIR/run" "$K8S_DIR/logs"
NODE_IP=$(node_ip)

# --- 1. packages ------------------------------------------------------------
need_pkgs=()
for p in containernetworking-plugins iptables conntrack busybox-static libseccomp-dev pkg-config; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_pkgs[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}" >/dev/null
fi

# --- 2. binaries, certificates -----------------------------------------------
bash "$K8S_SCRIPTS/build.sh" node
bash "$K8S_SCRIPTS/pki.sh"

running() { [ -f "$K8S_DIR/run/$1.pid" ] && kill -0 "$(cat "$K8S_DIR/run/$1.pid")" 2>/dev/null; }
start() {  # start NAME CMD...: detached, logs in $K8S_DIR/logs/NAME.log
  local name=$1; shift
  if running "$name"; then return 0; fi
  setsid nohup "$@" >>"$K8S_DIR/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$K8S_DIR/run/$name.pid"
  log "$name: started (pid $!)"
}
wait_for() {  # wait_for LABEL SECONDS CMD...
  local label=$1 secs=$2; shift 2
  local t0; t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) - t0 > secs )) && die "$label not ready after ${secs}s (logs: $K8S_DIR/logs)"
    sleep 1
  done
}
P="$K8S_DIR/pki"

# --- 3. the control plane -----------------------------------------------------
start etcd "$K8S_BIN/etcd" --name temper --data-dir "$K8S_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster temper=http://127.0.0.1:2380 --quota-backend-bytes 2147483648
wait_for etcd 60 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

start kube-apiserver "$K8S_BIN/kube-apiserver" \
  --advertise-address "$NODE_IP" --bind-address 0.0.0.0 --secure-port "$APISERVER_PORT" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged=true \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
  --client-ca-file "$P/ca.crt" --tls-cert-file "$P/apiserver.crt" --tls-private-key-file "$P/apiserver.key" \
  --kubelet-client-certificate "$P/apiserver-kubelet-client.crt" --kubelet-client-key "$P/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority "$P/ca.crt" --kubelet-preferred-address-types Hostname,InternalIP \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$P/sa.pub" --service-account-signing-key-file "$P/sa.key" \
  --proxy-client-cert-file "$P/front-proxy-client.crt" --proxy-client-key-file "$P/front-proxy-client.key" \
  --requestheader-client-ca-file "$P/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
  --requestheader-extra-headers-prefix X-Remote-Extra- --requestheader-group-headers X-Remote-Group \
  --requestheader-username-headers X-Remote-User --enable-aggregator-routing=true \
  --storage-media-type application/json --event-ttl 1h
wait_for kube-apiserver 180 kubectl_ get --raw /readyz

start kube-controller-manager "$K8S_BIN/kube-controller-manager" \
  --kubeconfig "$K8S_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$K8S_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$K8S_DIR/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials \
  --root-ca-file "$P/ca.crt" --service-account-private-key-file "$P/sa.key" \
  --cluster-signing-cert-file "$P/ca.crt" --cluster-signing-key-file "$P/ca.key" \
  --service-cluster-ip-range "$SERVICE_CIDR" --allocate-node-cidrs=true --cluster-cidr "$POD_CIDR" \
  --node-cidr-mask-size 24 --controllers '*,bootstrapsigner,tokencleaner' \
  --horizontal-pod-autoscaler-sync-period 10s
start kube-scheduler "$K8S_BIN/kube-scheduler" --kubeconfig "$K8S_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig "$K8S_DIR/scheduler.kubeconfig" \
  --authorization-kubeconfig "$K8S_DIR/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --leader-elect=false

# --- containerd, with its own socket and state ------------------------------------
mkdir -p "$(dirname "$CONTAINERD_SOCK")" "$K8S_DIR/cni/net.d"
cat > "$K8S_DIR/containerd.toml" <<TOML
version = 3
root = "$K8S_DIR/containerd/root"
state = "/run/temper-k8s/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "$PAUSE_IMAGE"
[plugins."io.containerd.cri.v1.runtime"]
  # root here lacks CAP_SYS_RESOURCE: without this, pod sandboxes fail with
  # "can't get final child's PID from pipe: EOF" (shared/FACTS.md)
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$K8S_DIR/cni/net.d"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      BinaryName = "$K8S_BIN/runc"
TOML
# The pod network: one bridge, host-local addresses from the node's pod range, NAT out.
cat > "$K8S_DIR/cni/net.d/10-temper.conflist" <<JSON
{"cniVersion": "1.0.0", "name": "temper", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}},
  {"type": "loopback"}]}
JSON
# its shim is found on PATH: the one built with it, not a Debian one
start containerd env PATH="$K8S_BIN:$PATH" "$K8S_BIN/containerd" --config "$K8S_DIR/containerd.toml"
wait_for containerd 60 ctr_ version

# --- images the node needs (built here, never pulled) ---------------------------
bash "$K8S_SCRIPTS/images.sh" node

# --- kubelet and kube-proxy ---------------------------------------------------
modprobe br_netfilter 2>/dev/null || true
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
cat > "$K8S_DIR/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$P/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$P/kubelet-serving.crt"
tlsPrivateKeyFile: "$P/kubelet-serving.key"
clusterDNS: ["$DNS_IP"]
clusterDomain: cluster.local
resolvConf: "$K8S_DIR/resolv.conf"
podCIDR: "$POD_CIDR"
maxPods: 60
# The root filesystem here reports ~12.6% free: below the default eviction and image-GC
# thresholds, which would evict every pod (shared/FACTS.md).
evictionHard: {"memory.available": "200Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"}
# Image GC off (100): no registry can give back an image it removes. A warm rerun that
# filled the disk lost KEDA's, busybox's and mc's images to it, and their pods never started.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
failSwapOn: false
serializeImagePulls: false
YAML
# Pods resolve through CoreDNS; the kubelet's own upstream is the host's.
grep -v '^search' /etc/resolv.conf > "$K8S_DIR/resolv.conf" 2>/dev/null || true
[ -s "$K8S_DIR/resolv.conf" ] || echo "nameserver 127.0.0.53" > "$K8S_DIR/resolv.conf"
start kubelet "$K8S_BIN/kubelet" --config "$K8S_DIR/kubelet.yaml" --kubeconfig "$K8S_DIR/kubelet.kubeconfig" \
  --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --root-dir "$K8S_DIR/kubelet" \
  --v 1
cat > "$K8S_DIR/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$K8S_DIR/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: "$POD_CIDR"
hostnameOverride: "$NODE_NAME"
conntrack: {maxPerCore: 0}
YAML
start kube-proxy "$K8S_BIN/kube-proxy" --config "$K8S_DIR/kube-proxy.yaml"
wait_for "node $NODE_NAME Ready" 180 bash -c "'$K8S_BIN/kubectl' --kubeconfig '$K8S_DIR/admin.kubeconfig' get node $NODE_NAME -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -q True"

# --- add-ons: CoreDNS, the storage provisioner -----------------------------------
export COREDNS_IMAGE LOCAL_PATH_IMAGE BUSYBOX_IMAGE DNS_IP K8S_DIR
for f in "$K8S_SCRIPTS"/addons/*.yaml; do
  envsubst '${COREDNS_IMAGE} ${LOCAL_PATH_IMAGE} ${BUSYBOX_IMAGE} ${DNS_IP} ${K8S_DIR}' < "$f"; echo "---"
done | kubectl_ apply -f - >/dev/null
kubectl_ -n kube-system rollout status deploy/coredns --timeout 180s >/dev/null
kubectl_ -n local-path-storage rollout status deploy/local-path-provisioner --timeout 180s >/dev/null
log "up: Kubernetes $K8S_VERSION on $NODE_IP:$APISERVER_PORT in $(( $(date +%s) - t_start ))s; kubeconfig $K8S_DIR/admin.kubeconfig"
