"""The server and the adapter-store sidecar share the pod's network: two container ports
with one number would fail at start ("Address already in use"), so the chart refuses them."""

from __future__ import annotations

import pytest
from helm_chart_helpers import render, render_error

TLS = {"tls": {"secretName": "t"}}


@pytest.mark.parametrize(("values", "first", "second", "port"), [
    ({**TLS, "tls": {"secretName": "t", "healthPort": 8000}}, "server.httpPort", "tls.healthPort", 8000),
    ({"server": {"grpcPort": 50061}}, "server.grpcPort", "adapterStore.grpcPort", 50061),
    ({"server": {"metricsPort": 9465}}, "server.metricsPort", "adapterStore.metricsPort", 9465),
    ({"server": {"httpPort": 9464}}, "server.metricsPort", "server.httpPort", 9464),
    ({"adapterStore": {"grpcPort": 8000}}, "server.httpPort", "adapterStore.grpcPort", 8000),
    ({"adapterStore": {"metricsPort": 50051}}, "server.grpcPort", "adapterStore.metricsPort", 50051),
    ({"tls": {"secretName": "t", "healthPort": 50061}}, "tls.healthPort", "adapterStore.grpcPort", 50061),
    ({"tls": {"secretName": "t", "healthPort": 50051}}, "server.grpcPort", "tls.healthPort", 50051),
])
def test_a_port_used_twice_in_the_pod_is_refused_naming_both_values(values: dict, first: str, second: str,
                                                                    port: int) -> None:
    message = render_error(values)
    assert f"{first} and {second} are both {port}" in message, message


@pytest.mark.parametrize("values", [
    {},
    TLS,
    # ports that are off do not count: httpPort 0, no store metrics, healthPort without TLS
    {"server": {"httpPort": 0}, "adapterStore": {"metricsPort": 0}, "tls": {"healthPort": 8000}},
])
def test_rendered_pod_ports_are_distinct(values: dict) -> None:
    pod = render(values).pod
    ports = [p["containerPort"] for c in pod["containers"] + pod.get("initContainers", []) for p in c.get("ports", [])]
    assert ports and len(ports) == len(set(ports)), ports


@pytest.mark.parametrize(("values", "first", "second", "port"), [
    ({"service": {"httpPort": 50051}}, "service.grpcPort", "service.httpPort", 50051),
    ({"service": {"metricsPort": 9465}}, "service.metricsPort", "adapterStore.metricsPort", 9465),
])
def test_a_service_port_used_twice_is_refused_naming_both_values(values: dict, first: str, second: str,
                                                                 port: int) -> None:
    # the API server refuses the Service ("spec.ports[...]: Duplicate value")
    message = render_error(values)
    assert f"{first} and {second} are both {port}" in message, message


@pytest.mark.parametrize("values", [
    {"server": {"httpPort": 0}, "service": {"httpPort": 50051}},  # ports that are off do not count
    {"adapterStore": {"metricsPort": 0}, "service": {"metricsPort": 9465}},
    # the client Service and the metrics Service are two Services: one number on each is fine
    {"service": {"httpPort": 9464}},
    {"service": {"grpcPort": 9465}},
])
def test_each_services_rendered_ports_are_distinct(values: dict) -> None:
    for service in render(values).all("Service"):
        ports = [p["port"] for p in service["spec"]["ports"]]
        assert len(ports) == len(set(ports)), (service["metadata"]["name"], ports)
