#!/usr/bin/env bash
# Images for the node's containerd, built here (no registry is reachable) and imported
# into its k8s.io namespace. Idempotent: an image already there is kept.
#   images.sh node     the pause sandbox image, CoreDNS, local-path-provisioner, busybox
#                      (single-layer archives of static binaries: oci_image.py)
#   images.sh keda     KEDA's operator and metrics adapter (static binaries, as above)
#   images.sh temper   Temper's image and the servers' (scripts/compose/build.sh, with a
#                      Docker engine), saved from Docker and imported
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
OUT="$K8S_CACHE/images"
mkdir -p "$OUT"

# grep reads the whole list: `grep -q` stops at the first match, ctr dies of SIGPIPE on the
# rest, and pipefail made a registered image look missing (a cold run failed on it).
have_image() { ctr_ images ls -q 2>/dev/null | grep -x "$1" >/dev/null; }
static_image() {  # static_image NAME TARFILE oci_image.py-args...
  local name=$1 tarball=$OUT/$2; shift 2
  have_image "$name" && return 0
  python3 "$K8S_SCRIPTS/oci_image.py" "$tarball" "$name" "$@"
  ctr_ images import "$tarball" >/dev/null
  have_image "$name" || die "import of $name from $tarball did not register the name"
  log "image $name: imported"
}

node_images() {
  static_image "$PAUSE_IMAGE" pause.tar --add "$K8S_BIN/pause:/pause" --entrypoint /pause
  static_image "$COREDNS_IMAGE" coredns.tar --add "$K8S_BIN/coredns:/coredns" --entrypoint /coredns
  static_image "$LOCAL_PATH_IMAGE" local-path.tar \
    --add "$K8S_BIN/local-path-provisioner:/usr/bin/local-path-provisioner" --entrypoint /usr/bin/local-path-provisioner
  # The provisioner's helper pods run `sh` scripts to make and remove volume directories.
  local links=()
  for app in sh mkdir rm rmdir ls cat chmod chown mv cp sleep echo test; do links+=(--link "/bin/$app:busybox"); done
  static_image "$BUSYBOX_IMAGE" busybox.tar --add /bin/busybox:/bin/busybox "${links[@]}" --entrypoint /bin/sh
}

# Temper's images come from the compose build (Dockerfile, deploy/compose/servers.Dockerfile),
# tagged with the names k8s/ uses, then `docker save | ctr import`.
temper_images() {
  # MinIO's client for the bucket Job: mc beside a busybox shell (the Job runs `sh -c`).
  local links=()
  for app in sh cat echo test; do links+=(--link "/bin/$app:busybox"); done
  static_image "$MC_IMAGE" mc.tar --add "$K8S_BIN/mc:/usr/bin/mc" --add /bin/busybox:/bin/busybox "${links[@]}" --entrypoint /usr/bin/mc
  bash "$REPO_ROOT/scripts/compose/build.sh"
  local pairs=(
    "temper:local=$TEMPER_IMAGE"
    "temper-redis:local=$REDIS_IMAGE"
    "temper-minio:local=$MINIO_IMAGE"
    "temper-kafka:local=$KAFKA_IMAGE"
    "temper-postgres:local=$POSTGRES_IMAGE"
  )
  for pair in "${pairs[@]}"; do
    local src=${pair%%=*} dst=${pair#*=}
    local id; id=$(docker image inspect -f '{{.Id}}' "$src")
    if have_image "$dst" && [ "$(cat "$OUT/${src//[:\/]/_}.id" 2>/dev/null)" = "$id" ]; then continue; fi
    local before; before=$(docker image inspect -f '{{.Id}}' "$dst" 2>/dev/null || true)
    docker tag "$src" "$dst"
    docker save "$dst" | ctr_ images import - >/dev/null
    # The image this name held is untagged now: a rebuilt Temper image left 7 GB behind per
    # run, and a warm rerun filled the disk. Removed unless something else still names it.
    if [ -n "$before" ] && [ "$before" != "$id" ]; then docker rmi "$before" >/dev/null 2>&1 || true; fi
    echo "$id" > "$OUT/${src//[:\/]/_}.id"
    log "image $dst: imported from Docker's $src"
  done
}

# KEDA's operator and metrics adapter, at the paths its own manifests run them from, as the
# non-root user its images declare (its Deployments say runAsNonRoot without a uid).
keda_images() {
  static_image "$KEDA_IMAGE" keda.tar --add "$K8S_BIN/keda-operator:/keda" --entrypoint /keda --user 65532:65532
  static_image "$KEDA_ADAPTER_IMAGE" keda-adapter.tar --add "$K8S_BIN/keda-adapter:/keda-adapter" \
    --entrypoint /keda-adapter --user 65532:65532
}

case ${1:-node} in
  node) node_images ;;
  keda) keda_images ;;
  temper) temper_images ;;
  *) die "images.sh node|keda|temper" ;;
esac
