"""Where the Prometheus endpoints are reachable from. They are plain HTTP even with TLS on, and
their labels carry adapter names, so they never ride on the client Service: with
service.type LoadBalancer (or NodePort) that Service faces the internet. They have a ClusterIP
Service of their own, which the ServiceMonitor scrapes."""

from __future__ import annotations

import pytest
from helm_chart_helpers import FULLNAME, Rendered, render

MONITORING = ("monitoring.coreos.com/v1",)
METRICS_PORTS = {"metrics", "store-metrics"}
TLS = {"tls": {"secretName": "lp-tls"}}


def port_names(service: dict) -> set[str]:
    return {p["name"] for p in service["spec"]["ports"]} | {str(p["targetPort"]) for p in service["spec"]["ports"]}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("service_type", ["ClusterIP", "NodePort", "LoadBalancer"])
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_metrics_ports_stay_off_the_client_service(service_type: str, tls: bool) -> None:
    r = render({"service": {"type": service_type, "headless": {"enabled": True}}, **(TLS if tls else {})},
               api_versions=MONITORING)
    client = r.get("Service")
    assert client["spec"]["type"] == service_type
    assert not port_names(client) & METRICS_PORTS, client["spec"]["ports"]
    assert not port_names(r.get("Service", f"{FULLNAME}-headless")) & METRICS_PORTS
    metrics = r.get("Service", f"{FULLNAME}-metrics")
    assert metrics["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {p["name"]: p["port"] for p in metrics["spec"]["ports"]} == {"metrics": 9464, "store-metrics": 9465}
    pod_labels = r.get("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(metrics["spec"]["selector"], pod_labels)
    container_ports = {p["name"] for c in r.pod["containers"] + r.pod["initContainers"] for p in c.get("ports", [])}
    assert {p["targetPort"] for p in metrics["spec"]["ports"]} <= container_ports


def scraped_services(r: Rendered) -> list[str]:
    sm = r.get("ServiceMonitor")
    return [s["metadata"]["name"] for s in r.all("Service")
            if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer"])
def test_the_service_monitor_scrapes_the_metrics_service_only(service_type: str) -> None:
    r = render({"service": {"type": service_type, "headless": {"enabled": True}}, "redis": {"mode": "bundled"},
                "adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}}, api_versions=MONITORING)
    assert scraped_services(r) == [f"{FULLNAME}-metrics"]
    endpoints = [e["port"] for e in r.get("ServiceMonitor")["spec"]["endpoints"]]
    assert endpoints == ["metrics", "store-metrics"]
    assert set(endpoints) <= port_names(r.get("Service", f"{FULLNAME}-metrics"))


def test_without_store_metrics_the_metrics_service_has_the_servers_alone() -> None:
    r = render({"adapterStore": {"metricsPort": 0}, "service": {"metricsPort": 9100}}, api_versions=MONITORING)
    metrics = r.get("Service", f"{FULLNAME}-metrics")
    assert [(p["name"], p["port"]) for p in metrics["spec"]["ports"]] == [("metrics", 9100)]
    assert [e["port"] for e in r.get("ServiceMonitor")["spec"]["endpoints"]] == ["metrics"]
    assert f"{FULLNAME}-metrics.ml.svc:9100/metrics" in r.notes
