"""Who the server pods' NetworkPolicy lets in, port by port. Clients (grpc, http) and scrapers
(metrics, store-metrics) have peer lists of their own: networkPolicy.ingressFrom and
networkPolicy.metricsFrom. With one rule for every port, restricting the metrics to the
scrapers, as the README advised, also shut out every gRPC and HTTP client.

The policy is read the way Kubernetes reads it (rules OR-ed; a rule admits a port it lists,
from any of its peers, or from anywhere without peers), for peers given by matchLabels."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helm_chart_helpers import NAMESPACE, render

CLIENT_PORTS = ("grpc", "http")
METRICS_PORTS = ("metrics", "store-metrics")


def in_namespace(name: str) -> dict:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


@dataclass(frozen=True)
class Source:
    """A pod that opens a connection: its namespace's labels and its own."""

    namespace: str
    labels: dict[str, str] = field(default_factory=dict)

    def matches(self, peer: dict) -> bool:
        ns_labels = {"kubernetes.io/metadata.name": self.namespace}
        if "namespaceSelector" in peer:
            ns_ok = peer["namespaceSelector"].get("matchLabels", {}).items() <= ns_labels.items()
        else:  # a podSelector alone selects pods of the policy's namespace
            ns_ok = self.namespace == NAMESPACE
        pod_ok = peer.get("podSelector", {}).get("matchLabels", {}).items() <= self.labels.items()
        return ns_ok and pod_ok


def admitted(policy: dict, source: Source) -> set[str]:
    """The named ports of the server pods ``source`` may connect to."""
    ports: set[str] = set()
    for rule in policy["spec"]["ingress"]:
        if "from" not in rule or any(source.matches(peer) for peer in rule["from"]):
            ports |= {p["port"] for p in rule["ports"]}
    return ports


APPS, MONITORING, ELSEWHERE = Source("apps"), Source("monitoring"), Source("other")


def policy_for(network_policy: dict) -> dict:
    return render({"networkPolicy": network_policy}).get("NetworkPolicy")


def test_scrapers_are_restricted_without_shutting_out_clients() -> None:
    policy = policy_for({"metricsFrom": [in_namespace("monitoring")]})
    for source in (APPS, ELSEWHERE):
        assert admitted(policy, source) == set(CLIENT_PORTS), source
    assert admitted(policy, MONITORING) == {*CLIENT_PORTS, *METRICS_PORTS}


def test_clients_and_scrapers_have_their_own_peers() -> None:
    policy = policy_for({"ingressFrom": [in_namespace("apps")], "metricsFrom": [in_namespace("monitoring")]})
    assert admitted(policy, APPS) == set(CLIENT_PORTS)
    assert admitted(policy, MONITORING) == set(METRICS_PORTS)
    assert admitted(policy, ELSEWHERE) == set()


def test_an_empty_metrics_from_admits_scrapers_from_anywhere() -> None:
    policy = policy_for({"ingressFrom": [in_namespace("apps")], "metricsFrom": []})
    assert admitted(policy, APPS) == {*CLIENT_PORTS, *METRICS_PORTS}
    assert admitted(policy, ELSEWHERE) == set(METRICS_PORTS)


@pytest.mark.parametrize("network_policy", [{}, {"metricsFrom": None}], ids=["unset", "null"])
def test_ingress_from_alone_still_covers_every_port(network_policy: dict) -> None:
    """Values written before metricsFrom existed keep their meaning."""
    policy = policy_for({"ingressFrom": [in_namespace("apps")], **network_policy})
    assert admitted(policy, APPS) == {*CLIENT_PORTS, *METRICS_PORTS}
    assert admitted(policy, ELSEWHERE) == set()
    assert admitted(policy_for(network_policy), ELSEWHERE) == {*CLIENT_PORTS, *METRICS_PORTS}


def test_ports_that_are_off_are_not_admitted_and_the_sidecars_grpc_never_is() -> None:
    r = render({"server": {"httpPort": 0}, "adapterStore": {"metricsPort": 0},
                "networkPolicy": {"metricsFrom": [in_namespace("monitoring")]}})
    policy = r.get("NetworkPolicy")
    assert admitted(policy, APPS) == {"grpc"}
    assert admitted(policy, MONITORING) == {"grpc", "metrics"}
    named = {p["name"] for c in r.pod["containers"] + r.pod["initContainers"] for p in c.get("ports", [])}
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= named
    assert "store-grpc" not in admitted(policy_for({}), APPS)
