#!/usr/bin/env bash
# Install the system packages (Debian/Ubuntu) that a use of Temper needs, by group:
#
#   scripts/setup_system.sh run      running jobs: temper run / temper serve / make run
#   scripts/setup_system.sh test     the test suite: run's, plus the browser and promtool
#   scripts/setup_system.sh deploy   make check-deploy: promtool
#   scripts/setup_system.sh images   building Debian task images: mmdebstrap
#   scripts/setup_system.sh langs    programs in C, C++, Java, Go, Rust, JavaScript, TypeScript (docs/sandbox.md)
#   scripts/setup_system.sh [all]    every group (the default)
#   scripts/setup_system.sh --list GROUP...   print the packages, install nothing
#
# Idempotent: packages already installed are skipped, so every `make` target may call it.
# The langs group comes without recommended packages (about 830 MB installed), and only
# from Debian: a nodejs of another origin (NodeSource's) is replaced by Debian's, since
# sandboxes run the distribution's toolchains at their /usr paths.
set -euo pipefail

# Debian 12: gcc/g++ 12, OpenJDK 17 (+ javatuples, which MultiPL-E's Java imports), Go 1.19,
# rustc 1.63, Node 18, TypeScript 4.8; libssl-dev because C++ links OpenSSL as SandboxFusion does.
LANGS="gcc g++ libssl-dev openjdk-17-jdk-headless libjavatuples-java golang-go rustc nodejs node-typescript"

packages_of() {
  case "$1" in
    run) echo bubblewrap libseccomp2 ;;                       # the sandbox backend (namespaces; its seccomp filter, through ctypes)
    test) packages_of run; echo chromium chromium-driver; packages_of deploy; packages_of images; packages_of langs ;;  # browser tests (Selenium gets /usr/bin/chromedriver: nothing downloaded)
    deploy) echo prometheus ;;                                # promtool, for the alert-rule checks
    images) echo mmdebstrap ;;                                # Debian task images (docs/sandbox.md)
    langs) echo "$LANGS" ;;                                   # the toolchains of temper.sandbox.languages
    all) packages_of test ;;
    *) echo "unknown group '$1' (run, test, deploy, images, langs, all)" >&2; return 2 ;;
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

# Debian's version of a package (the newest one a debian.org archive offers).
debian_version() {
  apt-cache madison "$1" | awk -F'|' '$3 ~ /debian\.org/ {gsub(/ /, "", $2); print $2; exit}'
}

missing=()
langs=()
foreign=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null || true)
  if [[ "$status" == "install ok installed"* && "$status" != *nodesource* ]]; then
    continue
  fi
  [[ "$status" == *nodesource* ]] && foreign+=("$pkg")
  if [[ " $LANGS " == *" $pkg "* ]]; then langs+=("$pkg"); else missing+=("$pkg"); fi
done
if [ "${#missing[@]}" -eq 0 ] && [ "${#langs[@]}" -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
if [ "${#missing[@]}" -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
if [ "${#langs[@]}" -gt 0 ]; then
  pinned=()
  for pkg in "${langs[@]}"; do
    if [[ " ${foreign[*]} " == *" $pkg "* ]]; then
      version=$(debian_version "$pkg")
      echo "setup_system: replacing the installed $pkg ($(dpkg-query -W -f='${Version}' "$pkg")) with Debian's $version" >&2
      pinned+=("$pkg=$version")
    else
      pinned+=("$pkg")
    fi
  done
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends --allow-downgrades "${pinned[@]}"
fi
