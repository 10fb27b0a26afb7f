#!/usr/bin/env bash
# Re-resolve requirements.lock from pyproject.toml's ranges (run after changing a dependency).
# Versions already in the lock are kept where they still satisfy the ranges; pass
# --upgrade to move everything to the newest allowed versions.
set -euo pipefail
cd "$(dirname "$0")/.."
# uv verifies TLS with its own roots unless told to use the system's (which trust this
# machine's re-signing authority, as pip does through /etc/pip.conf).
SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt} \
  .venv/bin/uv pip compile pyproject.toml --extra dev --extra bench --python-version 3.11 --native-tls -q \
  -o requirements.lock "$@"
echo "lock: requirements.lock re-resolved; commit it with pyproject.toml"
