"""The chart's InferencePool (Gateway API Inference Extension, #28): rendered where the
inference.networking.k8s.io/v1 API exists, valid against the v1 API's fields, and wired to
the server pods' HTTP port, so an endpoint picker in front of k replicas routes by adapter."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helm_chart_helpers import FULLNAME, render, render_error

GIE = ("inference.networking.k8s.io/v1",)
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "inferencepool_v1.json").read_text())


def _pool(values: dict) -> tuple[dict, object]:
    r = render(values, api_versions=GIE)
    return r.get("InferencePool"), r


def test_the_pool_selects_the_server_pods_on_their_http_port() -> None:
    pool, r = _pool({"inferencePool": {"enabled": True}})
    jsonschema.validate(pool, SCHEMA)
    deployment = next(d for d in r.all("Deployment") if d["metadata"]["name"] == FULLNAME)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    server = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
    http = next(p["containerPort"] for p in server["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    assert pool["spec"]["endpointPickerRef"] == {"name": f"{FULLNAME}-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}


def test_the_endpoint_picker_and_port_are_values() -> None:
    pool, _ = _pool({"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "port": 9102,
                                                                          "failureMode": "FailOpen"}},
                     "server": {"httpPort": 8080}})
    jsonschema.validate(pool, SCHEMA)
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "epp", "port": {"number": 9102}, "failureMode": "FailOpen"}


def test_no_pool_without_the_api_or_when_off_and_none_without_the_http_port() -> None:
    assert not render({"inferencePool": {"enabled": True}}).all("InferencePool")
    assert not render(api_versions=GIE).all("InferencePool")  # off by default
    assert "needs server.httpPort" in render_error({"inferencePool": {"enabled": True}, "server": {"httpPort": 0}},
                                                   api_versions=GIE)


@pytest.mark.parametrize("bad", [{"endpointPicker": {"port": 0}}, {"endpointPicker": {"failureMode": "Maybe"}},
                                 {"endpointPicker": {"nam": "x"}}])
def test_bad_pool_values_are_refused_by_the_chart_schema(bad: dict) -> None:
    assert "inferencePool" in render_error({"inferencePool": {"enabled": True, **bad}}, api_versions=GIE)


def test_the_schema_catches_what_the_api_would_refuse() -> None:
    """The schema is a check, not a formality: a pool without targetPorts or with a port out of
    range fails it."""
    pool, _ = _pool({"inferencePool": {"enabled": True}})
    for broken in ({**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}},
                   {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)
