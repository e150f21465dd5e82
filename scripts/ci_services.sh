#!/usr/bin/env bash
# Make sure the real services the adapter store tests use are installed (idempotent):
#   - redis-server (Debian package), started by the tests themselves on free loopback ports;
#   - moto's S3 server comes with the Python test extras (pip install -e '.[test]').
# Usage: scripts/ci_services.sh   (run before the test suite; safe to run again)
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "ci_services: $(redis-server --version | cut -d' ' -f1-3) already installed"
else
    SUDO=""
    if [ "$(id -u)" != "0" ]; then
        command -v sudo >/dev/null 2>&1 || { echo "ci_services: need root or sudo to apt-get install redis-server" >&2; exit 1; }
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    # The package may start a system instance on 6379; the tests never use it (own ports).
    echo "ci_services: installed $(redis-server --version | cut -d' ' -f1-3)"
fi
