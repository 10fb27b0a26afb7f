#!/usr/bin/env bash
# Install the system packages Temper needs (Debian/Ubuntu). Idempotent: packages that
# are already installed are skipped, so it is safe to run on every `make` that needs it.
set -euo pipefail

PACKAGES=(
  bubblewrap   # the sandbox backend (user/pid/mount/net namespaces)
  prometheus   # promtool, for the alert-rule checks (make check-deploy)
  chromium          # headless browser for the web console's browser tests (pytest -m browser)
  chromium-driver   # /usr/bin/chromedriver, given to Selenium so it never downloads one
)

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
