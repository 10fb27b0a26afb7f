#!/usr/bin/env bash
# Install the system packages (Debian/Ubuntu) that a use of Temper needs, by group:
#
#   scripts/setup_system.sh run      running jobs: temper run / temper serve / make run
#   scripts/setup_system.sh test     the test suite: run's, plus the browser and promtool
#   scripts/setup_system.sh deploy   make check-deploy: promtool
#   scripts/setup_system.sh images   building Debian task images: mmdebstrap
#   scripts/setup_system.sh [all]    every group (the default)
#   scripts/setup_system.sh --list GROUP...   print the packages, install nothing
#
# Idempotent: packages already installed are skipped, so every `make` target may call it.
set -euo pipefail

packages_of() {
  case "$1" in
    run) echo bubblewrap libseccomp2 ;;                       # the sandbox backend (namespaces; its seccomp filter, through ctypes)
    test) packages_of run; echo chromium chromium-driver; packages_of deploy; packages_of images ;;  # browser tests (Selenium gets /usr/bin/chromedriver: nothing downloaded)
    deploy) echo prometheus ;;                                # promtool, for the alert-rule checks
    images) echo mmdebstrap ;;                                # Debian task images (docs/sandbox.md)
    all) packages_of test ;;
    *) echo "unknown group '$1' (run, test, deploy, images, all)" >&2; return 2 ;;
  esac
}

list=0
if [ "${1:-}" = "--list" ]; then list=1; shift; fi
groups=("$@")
[ "${#groups[@]}" -eq 0 ] && groups=(all)

PACKAGES=()
for group in "${groups[@]}"; do
  words=$(packages_of "$group") || exit 2
  for pkg in $words; do
    [[ " ${PACKAGES[*]} " == *" $pkg "* ]] || PACKAGES+=("$pkg")
  done
done
if [ "$list" -eq 1 ]; then
  echo "${PACKAGES[*]}"
  exit 0
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
