"""The Helm chart as Helm renders it: lint, Kubernetes API validity, and the wiring a user
relies on (sidecar, gRPC probes, settings the real server and store accept, no inlined
credentials, GPU or CPU, graceful termination, autoscaling, monitoring)."""

from __future__ import annotations

import json

import pytest
from helm_chart_helpers import (
    CHART, CI_VALUE_SETS, FULLNAME, KUBE_VERSIONS, Rendered, ci_values, env_of, import_tool, render,
)

from loraplex.adapter_store.main import parse_args as store_parse_args
from loraplex.inference_server.settings import ServerSettings

ALL_SETS = ("default", *CI_VALUE_SETS)
MONITORING = ("monitoring.coreos.com/v1",)


def values_of(name: str) -> dict:
    return {} if name == "default" else ci_values(name)


def configmaps(r: Rendered) -> dict[str, dict[str, str]]:
    return {c["metadata"]["name"]: c["data"] for c in r.all("ConfigMap")}


@pytest.mark.parametrize("name", ALL_SETS)
def test_helm_lint_strict_passes(name: str) -> None:
    helm = import_tool("helm_python")
    report = helm.lint(str(CHART), values_of(name) or None, strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not problems, (report["errors"], problems)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", ALL_SETS)
def test_every_manifest_validates_against_the_kubernetes_api(name: str, kube_version: str) -> None:
    kv = import_tool("kubernetes_validate")
    r = render(values_of(name), api_versions=MONITORING, kube_version=kube_version)
    kinds = {d["kind"] for d in r.docs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    for doc in r.docs:
        if doc["kind"] == "ServiceMonitor":  # a CRD: not in the Kubernetes API schemas
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]["endpoints"]
            continue
        # strict: unknown fields (a misspelt key) fail too
        kv.validate(doc, kube_version, strict=True)


@pytest.mark.parametrize("name", ALL_SETS)
def test_server_and_store_share_the_pod_and_accept_the_rendered_settings(name: str) -> None:
    r = render(values_of(name))
    assert [c["name"] for c in r.pod["containers"]] == ["server"]
    # Kubernetes >= 1.29: a native sidecar, the last init container (after fetch-model)
    assert r.pod["initContainers"][-1]["name"] == "adapter-store"
    assert r.container("adapter-store")["restartPolicy"] == "Always"
    cms = configmaps(r)
    # The real settings parsers accept what the chart renders (unknown or bad values raise).
    server_env = env_of(r.container("server"), cms)
    settings = ServerSettings.from_sources([], server_env)
    assert settings.host == "0.0.0.0"
    values = values_of(name)
    if (values.get("server") or {}).get("maxNumSeqs") is None:  # the server picks the batch for its device
        assert settings.max_num_seqs is None and "LORAPLEX_MAX_NUM_SEQS" not in server_env
    if (values.get("server") or {}).get("adapterPoolBytes") is None:  # sized from the GPU's memory
        assert settings.adapter_pool_bytes is None and "LORAPLEX_ADAPTER_POOL_BYTES" not in server_env
        assert settings.adapter_pool_memory_fraction == 0.5
    assert not [k for k in server_env if k.startswith("LORAPLEX_") and
                k.removeprefix("LORAPLEX_").lower() not in ServerSettings.__dataclass_fields__], \
        "a LORAPLEX_* variable the server does not read"
    secrets = {("loraplex-redis", "url"): "redis://:pw@redis.cache:6379/0"}
    store_settings, _ = store_parse_args([], env_of(r.container("adapter-store"), cms, secrets))
    store_port = int(store_settings.listen.rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in r.container("adapter-store")["ports"]}
    assert ports["store-grpc"] == store_port
    # the sidecar listens on every pod address (kubelet probes) and is not behind the Service
    assert store_settings.listen.startswith("0.0.0.0:")
    svc_ports = {p["targetPort"] for s in r.all("Service") for p in s["spec"]["ports"]}
    assert "store-grpc" not in svc_ports and {"grpc", "metrics"} <= svc_ports
    server_ports = {p["name"]: p["containerPort"] for p in r.container("server")["ports"]}
    health = {"health": settings.health_port} if settings.health_port else {}  # TLS: plaintext probe port
    http = {"http": settings.http_port} if settings.http_port else {}  # the OpenAI-compatible edge
    assert server_ports == {"grpc": settings.port, "metrics": settings.metrics_port} | health | http
    assert not http or "http" in svc_ports


@pytest.mark.parametrize("name", ALL_SETS)
def test_probes_use_grpc_health_on_the_serving_ports(name: str) -> None:
    values = values_of(name)
    r = render(values)
    server_cfg = r.config("server")
    # with TLS the kubelet (no TLS) probes the plaintext health-only port
    grpc_port = int(server_cfg.get("LORAPLEX_HEALTH_PORT", server_cfg["LORAPLEX_PORT"]))
    store_port = int(r.config("store")["LORAPLEX_STORE_LISTEN"].rsplit(":", 1)[1])
    for container, port in (("server", grpc_port), ("adapter-store", store_port)):
        c = r.container(container)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (container, probe)
    startup = r.container("server")["startupProbe"]
    max_load = values.get("probes", {}).get("startup", {}).get("maxLoadSeconds", 900)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= max_load


@pytest.mark.parametrize("name", ALL_SETS)
def test_containers_are_locked_down(name: str) -> None:
    r = render(values_of(name))
    pods = [r.pod] + [s["spec"]["template"]["spec"] for s in r.all("StatefulSet")]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            writable = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            if c["name"] != "redis":
                assert "emptyDir" in volumes[writable["/tmp"]], f"{c['name']}: /tmp must be a writable emptyDir"
    assert "emptyDir" in {v["name"]: v for v in r.pod["volumes"]}["cache"]


@pytest.mark.parametrize("name", ALL_SETS)
def test_no_credentials_are_inlined(name: str) -> None:
    r = render(values_of(name))
    # the one Secret the chart makes is the store's shared secret, generated (never from values)
    made = [d for d in r.all("Secret") if d["metadata"]["name"] != f"{FULLNAME}-store-secret"]
    assert not made, "the chart must not create Secrets from values"
    for c in r.pod["containers"] + r.pod.get("initContainers", []):
        for entry in c.get("env", []):
            if entry["name"].startswith("AWS_") or entry["name"].endswith("REDIS_URL"):
                assert "secretKeyRef" in entry.get("valueFrom", {}), (c["name"], entry)
    for data in configmaps(r).values():
        for key, value in data.items():
            assert not key.startswith("AWS_"), key
            if key.endswith("REDIS_URL"):
                assert "@" not in value, "a Redis URL with credentials in a ConfigMap"


def test_secret_references_follow_the_values() -> None:
    r = render(ci_values("external"))
    env = {e["name"]: e for e in r.container("adapter-store")["env"]}
    refs = {n: e["valueFrom"]["secretKeyRef"] for n, e in env.items() if "valueFrom" in e}
    assert refs == {
        "LORAPLEX_STORE_REDIS_URL": {"name": "loraplex-redis", "key": "url"},
        "AWS_ACCESS_KEY_ID": {"name": "loraplex-s3", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "loraplex-s3", "key": "AWS_SECRET_ACCESS_KEY"},
        "AWS_SESSION_TOKEN": {"name": "loraplex-s3", "key": "AWS_SESSION_TOKEN"},
    }
    assert "LORAPLEX_STORE_REDIS_URL" not in r.config("store")
    # without a Secret the pod identity is used: no AWS variables at all
    r = render({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}})
    assert not [e for e in r.container("adapter-store")["env"] if e["name"].startswith("AWS_")]


def test_gpu_mode_requests_the_gpu_and_cpu_mode_does_not() -> None:
    gpu = render()
    limits = gpu.container("server")["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu.pod["tolerations"]
    assert gpu.config("server")["LORAPLEX_DEVICE"] == "cuda"
    cpu = render(ci_values("cpu"))
    for c in cpu.pod["containers"]:
        for section in ("limits", "requests"):
            assert not [k for k in c["resources"].get(section, {}) if "gpu" in k], c["name"]
    assert "tolerations" not in cpu.pod
    assert cpu.config("server")["LORAPLEX_DEVICE"] == "cpu"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in cpu.container("server")["env"]


def test_scheduling_values_reach_the_pod() -> None:
    values = ci_values("gpu")
    r = render(values)
    pod = r.pod
    assert pod["nodeSelector"] == values["nodeSelector"] and pod["affinity"] == values["affinity"]
    assert values["tolerations"][0] in pod["tolerations"]
    assert pod["priorityClassName"] == "inference-high" and pod["runtimeClassName"] == "nvidia"
    cfg = r.config("server")
    assert cfg["LORAPLEX_MODEL"] == "/models/Llama-3.1-8B-Instruct" and cfg["LORAPLEX_MODEL_FORMAT"] == "hf"
    assert cfg["LORAPLEX_DTYPE"] == "bfloat16" and cfg["LORAPLEX_MAX_MODEL_LEN"] == "8192"
    assert cfg["LORAPLEX_MAX_NUM_SEQS"] == "128" and cfg["LORAPLEX_ADAPTER_POOL_BYTES"] == "4294967296"
    model = {v["name"]: v for v in pod["volumes"]}["model"]
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    # the sidecar reads the HF config.json to check adapter shapes
    assert r.config("store")["LORAPLEX_STORE_BASE_CONFIG"] == "/models/Llama-3.1-8B-Instruct"
    mounts = {m["name"]: m for m in r.container("adapter-store")["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True


@pytest.mark.parametrize(("mode", "kube_version", "native"), [
    ("auto", "1.30.0", True), ("auto", "1.28.0", False), (False, "1.34.0", False), (True, "1.29.0", True),
])
def test_termination_grace_covers_prestop_and_drain(mode: object, kube_version: str, native: bool) -> None:
    values = {"server": {"drainSeconds": 120, "preStopDelaySeconds": 7, "shutdownMarginSeconds": 20},
              "adapterStore": {"nativeSidecar": mode}}
    r = render(values, kube_version=kube_version)
    assert r.pod["terminationGracePeriodSeconds"] == 147
    assert r.config("server")["LORAPLEX_GRACE_PERIOD_S"] == "120"
    assert r.container("server")["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    store = r.container("adapter-store")
    if native:  # Kubernetes stops a native sidecar only after the server has exited
        assert store["restartPolicy"] == "Always" and "lifecycle" not in store
        assert store in r.pod["initContainers"] and store not in r.pod["containers"]
    else:  # a plain second container stays up, by its preStop, until the server has drained
        assert [c["name"] for c in r.pod["containers"]] == ["server", "adapter-store"]
        assert store["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "127"]
        assert "restartPolicy" not in store


def test_hpa_scales_on_a_server_metric_with_cpu_fallback() -> None:
    from loraplex.inference_server.edge.metrics import ServerMetrics  # noqa: PLC0415

    exported = {m.name for m in ServerMetrics().registry.collect()}
    r = render(ci_values("external"))
    hpa = r.get("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    pods, cpu = hpa["spec"]["metrics"]
    assert pods["pods"]["metric"]["name"] == "loraplex_running_requests" in exported
    assert cpu["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}
    assert "replicas" not in r.get("Deployment")["spec"], "the HPA owns the replica count"
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = schema["properties"]["autoscaling"]["properties"]["customMetric"]["properties"]["name"]["enum"]
    assert set(allowed) <= exported, "the schema offers a metric the server does not export"
    cpu_only = render(ci_values("hpa-cpu")).get("HorizontalPodAutoscaler")
    assert [m["type"] for m in cpu_only["spec"]["metrics"]] == ["Resource"]
    assert not render().all("HorizontalPodAutoscaler")


def test_service_monitor_only_where_the_crd_exists() -> None:
    assert not render().all("ServiceMonitor")
    r = render(api_versions=MONITORING)
    sm = r.get("ServiceMonitor")
    metrics_service = r.get("Service", f"{FULLNAME}-metrics")  # test_helm_metrics_exposure.py: never the client one
    svc_ports = {p["name"] for p in metrics_service["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "store-metrics"]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= svc_ports
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    assert "ServiceMonitor was created" in r.notes
    assert not render({"serviceMonitor": {"enabled": False}}, api_versions=MONITORING).all("ServiceMonitor")


def test_s3_model_is_fetched_by_an_init_container() -> None:
    r = render(ci_values("external"))
    init = r.container("fetch-model")
    # the model is in place before the sidecar (which reads its config.json) and the server start
    assert [c["name"] for c in r.pod["initContainers"]] == ["fetch-model", "adapter-store"]
    assert init["image"] == r.container("adapter-store")["image"]
    assert "--bucket=models" in init["args"] and "--prefix=qwen2.5-7b-instruct/" in init["args"]
    assert "--dest=/models" in init["args"] and "--region=eu-west-1" in init["args"]
    script = r.get("ConfigMap", f"{FULLNAME}-scripts")["data"]["fetch_model.py"]
    assert script == (CHART / "files" / "fetch_model.py").read_text()
    volumes = {v["name"]: v for v in r.pod["volumes"]}
    assert "emptyDir" in volumes["model"]
    server_mounts = {m["name"]: m for m in r.container("server")["volumeMounts"]}
    assert server_mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert r.config("server")["LORAPLEX_MODEL"] == "/models"


def test_bundled_redis_is_wired_to_the_sidecar() -> None:
    r = render(ci_values("bundled-redis"))
    sts = r.get("StatefulSet", f"{FULLNAME}-redis")
    svc = r.get("Service", f"{FULLNAME}-redis")
    assert sts["spec"]["serviceName"] == f"{FULLNAME}-redis-headless"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    port = svc["spec"]["ports"][0]["port"]
    assert r.config("store")["LORAPLEX_STORE_REDIS_URL"] == f"redis://{FULLNAME}-redis:{port}/0"
    assert r.config("store")["LORAPLEX_STORE_INDEX_BACKEND"] == "redis"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    policy = r.get("NetworkPolicy", f"{FULLNAME}-redis")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= r.get("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    assert not render().has("StatefulSet", f"{FULLNAME}-redis")


def test_headless_service_and_pdb() -> None:
    r = render(ci_values("external"))
    headless = r.get("Service", f"{FULLNAME}-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    assert r.get("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert render().get("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert not render().has("Service", f"{FULLNAME}-headless")


def test_notes_tell_how_to_reach_the_service_and_make_a_first_request() -> None:
    notes = render().notes
    assert f"port-forward svc/{FULLNAME} 50051:50051" in notes
    assert "loraplex generate" in notes and "loraplex health" in notes
    assert f"exec deploy/{FULLNAME} -c server -- loraplex --address 127.0.0.1:50051 generate" in notes
    assert f"{FULLNAME}.ml.svc:50051" in notes
    assert "nodePort" in render(ci_values("bundled-redis")).notes
