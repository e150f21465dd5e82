"""Object names at every release name length Helm allows (1..53): each fits a DNS-1035 label
(<= 63 characters), keeps its suffix, and is unique among the objects of its kind, so the
bundled Redis never takes the server's Service and the references between objects hold."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helm_chart_helpers import Rendered, render, render_error

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
APIS = ("monitoring.coreos.com/v1", "inference.networking.k8s.io/v1")
# Every object the chart can make: bundled Redis, headless Services, S3 model (scripts
# ConfigMap), HPA, PDB, NetworkPolicies, store Secret, ServiceMonitor, InferencePool.
EVERYTHING = {
    "model": {"source": "s3", "s3": {"bucket": "m", "prefix": "base/"}},
    "adapterStore": {"blobs": "s3", "s3": {"bucket": "a"}},
    "redis": {"mode": "bundled"},
    "autoscaling": {"enabled": True},
    "service": {"headless": {"enabled": True}},
    "inferencePool": {"enabled": True},
}


def release_names() -> list[str]:
    names = ["r" + "x" * (n - 1) for n in range(1, 54)]
    # names holding the chart's name are the full name themselves (no "-loraplex" added)
    names += [("loraplex-" + "y" * 60)[:n] for n in (8, 20, 40, 46, 47, 52, 53)]
    return names


def check_names(r: Rendered, release: str) -> None:
    by_kind: dict[str, list[str]] = {}
    for doc in r.docs:
        by_kind.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
    for kind, names in by_kind.items():
        for name in names:
            assert len(name) <= 63 and DNS_1035.match(name), (release, kind, name)
        assert not [n for n, c in Counter(names).items() if c > 1], (release, kind, names)
    services = set(by_kind["Service"])
    assert {n for n in services if n.endswith("-headless")} and {n for n in services if n.endswith("-redis")}
    assert {n for n in services if n.endswith("-metrics")}
    sts = r.all("StatefulSet")[0]
    # the pods' controller-revision-hash label "<statefulset>-<hash of up to 10>" must fit in 63
    assert len(sts["metadata"]["name"]) <= 52 and sts["metadata"]["name"].endswith("-redis")
    assert sts["spec"]["serviceName"] in services and sts["spec"]["serviceName"].endswith("-headless")
    redis_svc = r.get("Service", sts["metadata"]["name"])
    assert redis_svc["spec"]["selector"]["app.kubernetes.io/component"] == "redis"
    server_svc = r.get("Service", r.get("Deployment", r.all("Deployment")[0]["metadata"]["name"])["metadata"]["name"])
    assert server_svc["spec"]["selector"]["app.kubernetes.io/component"] == "server"
    # the store reaches the Redis Service, not the server's
    store_cm = [c for c in r.all("ConfigMap") if c["metadata"]["name"].endswith("-store")][0]
    assert store_cm["data"]["LORAPLEX_STORE_REDIS_URL"] == f"redis://{redis_svc['metadata']['name']}:6379/0"
    # every ConfigMap and Secret the pod names is one the chart made
    pod = r.all("Deployment")[0]["spec"]["template"]["spec"]
    configmaps = set(by_kind["ConfigMap"])
    for c in pod["containers"] + pod.get("initContainers", []):
        for source in c.get("envFrom", []):
            assert source["configMapRef"]["name"] in configmaps, (release, source)
    for volume in pod["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in configmaps, (release, volume)
    assert any(v.get("secret", {}).get("secretName") in by_kind["Secret"] for v in pod["volumes"])
    epp = r.all("InferencePool")[0]["spec"]["endpointPickerRef"]["name"]
    assert len(epp) <= 63 and DNS_1035.match(epp) and epp.endswith("-epp")


@pytest.mark.parametrize("release", release_names(), ids=len)
def test_every_object_name_fits_keeps_its_suffix_and_is_unique(release: str) -> None:
    check_names(render(EVERYTHING, api_versions=APIS, release=release), release)


def test_names_are_unchanged_for_a_short_release() -> None:
    r = render(EVERYTHING, api_versions=APIS)
    assert {d["metadata"]["name"] for d in r.all("Service")} == {
        "lp-loraplex", "lp-loraplex-headless", "lp-loraplex-metrics", "lp-loraplex-redis",
        "lp-loraplex-redis-headless"}
    assert {d["metadata"]["name"] for d in r.all("ConfigMap")} == {
        "lp-loraplex-server", "lp-loraplex-store", "lp-loraplex-scripts"}


def test_a_full_name_that_would_be_the_redis_name_is_refused() -> None:
    # 52 characters ending in "-redis": its Redis name (46 characters + "-redis") is itself
    name = "a" * 46 + "-redis"
    message = render_error({"fullnameOverride": name, "redis": {"mode": "bundled"}})
    assert "share a name" in message and "fullnameOverride" in message


def test_a_full_name_that_would_be_the_metrics_service_name_is_refused() -> None:
    # 62 characters ending in "-metrics": its metrics Service (54 characters + "-metrics") is itself
    message = render_error({"fullnameOverride": "a" * 54 + "-metrics"})
    assert "share a name" in message and "fullnameOverride" in message
