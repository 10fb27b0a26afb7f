# shellcheck shell=bash
# require_free_gb GB DIR WHAT: stop at once, saying so, when DIR's filesystem has less than
# GB gigabytes free. A pip install that fills the disk fails mid-way with "[Errno 28] No space
# left on device" and leaves half an environment; this says how much is needed before that.
# The figures passed are the installed sizes (measured), a lower bound: pip's downloads need more.
require_free_gb() {
  local need_gb=$1 dir=$2 what=$3 free_kb
  mkdir -p "$dir"
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  if (( free_kb < need_gb * 1024 * 1024 )); then
    echo "error: $what needs at least $need_gb GB free on the filesystem of $dir; it has $(( free_kb / 1024 )) MB free. Free some space and run it again." >&2
    exit 28
  fi
}
