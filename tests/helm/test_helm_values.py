"""Bad values stop `helm install` with a message that names the value: values.schema.json
(types, ranges, enums, unknown keys, inline credentials) and the chart's cross-value checks.
The schema's choices are the server's own (read from its settings module, not copied)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from helm_chart_helpers import CHART, CI_VALUE_SETS, env_of, render, render_error

from loraplex.inference_server.settings import DTYPES, MODEL_FORMATS, ServerSettings

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def server_env(rendered) -> dict[str, str]:
    configmaps = {c["metadata"]["name"]: c["data"] for c in rendered.all("ConfigMap")}
    return env_of(rendered.container("server"), configmaps)


def prop(*path: str) -> dict:
    node = SCHEMA
    for key in path:
        node = node["properties"][key]
    return node


@pytest.mark.parametrize(("values", "where", "words"), [
    ({"replicaCount": -1}, "/replicaCount", "minimum"),
    ({"replicaCount": "3"}, "/replicaCount", "want integer"),
    ({"model": {"dtype": "fp8"}}, "/model/dtype", "bfloat16"),
    ({"model": {"source": "git"}}, "/model/source", "embedded"),
    ({"gpu": {"count": 0}}, "/gpu/count", "minimum"),
    ({"server": {"grpcPort": 70000}}, "/server/grpcPort", "maximum"),
    ({"server": {"kvCacheMemoryFraction": 1.5}}, "/server/kvCacheMemoryFraction", "maximum"),
    ({"server": {"maxMessageBytes": 1024}}, "/server/maxMessageBytes", "minimum"),
    ({"server": {"logLevel": "verbose"}}, "/server/logLevel", "INFO"),
    ({"adapterStore": {"s3": {"prefix": "no-slash"}}}, "/adapterStore/s3/prefix", "pattern"),
    ({"redis": {"mode": "sentinel"}}, "/redis/mode", "bundled"),
    ({"autoscaling": {"customMetric": {"name": "gpu_util"}}}, "/autoscaling/customMetric/name", "loraplex_queue_length"),
    ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval", "pattern"),
    ({"server": {"connections": {"httpHeadTimeoutS": 0}}}, "/server/connections/httpHeadTimeoutS", "exclusiveMinimum"),
    ({"server": {"connections": {"httpMaxHeadBytes": 512}}}, "/server/connections/httpMaxHeadBytes", "minimum"),
    ({"server": {"connections": {"grpcPermitKeepaliveWithoutCalls": "yes"}}},
     "/server/connections/grpcPermitKeepaliveWithoutCalls", "on"),
    ({"server": {"connections": {"httpTimeout": 3}}}, "/server/connections", "'httpTimeout' not allowed"),
    ({"replicas": 2}, "''", "'replicas' not allowed"),
    ({"server": {"maxNumSeq": 8}}, "/server", "'maxNumSeq' not allowed"),
    # "redis:" does not parse, and the chart's appVersion is no Redis version
    ({"redis": {"mode": "bundled", "bundled": {"image": {"tag": ""}}}}, "/redis/bundled/image/tag", "minLength"),
])
def test_schema_rejects_bad_values_naming_them(values: dict, where: str, words: str) -> None:
    message = render_error(values)
    assert "schema" in message and f"at {where if where == chr(39) * 2 else repr(where)}" in message, message
    assert words in message, message


@pytest.mark.parametrize("values", [
    {"s3": {"accessKeyId": "AKIAEXAMPLEKEY123456", "secretAccessKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}},
    {"s3": {"credentials": {"secretAccessKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}}},
    {"adapterStore": {"s3": {"bucket": "b", "secretKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}}},
    {"model": {"s3": {"bucket": "b", "awsSecretAccessKey": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}}},
])
def test_inline_s3_credentials_are_refused_without_echoing_them(values: dict) -> None:
    message = render_error(values)
    assert "not allowed" in message, message
    assert "wJalrXUtnFEMI" not in message and "AKIAEXAMPLE" not in message, "the error leaks the secret"


SHARED_REDIS = {"redis": {"mode": "external", "external": {"url": "redis://redis:6379/0"}}}


@pytest.mark.parametrize(("values", "words"), [
    ({"replicaCount": 2}, "adapterStore.blobs=s3"),
    ({"autoscaling": {"enabled": True}}, "adapterStore.blobs=s3"),
    ({"model": {"source": "s3"}}, "model.s3.bucket"),
    ({"model": {"source": "volume"}}, "model.volume.claimName"),
    ({"model": {"source": "volume", "volume": {"claimName": "a", "hostPath": "/b"}}}, "exactly one"),
    ({"model": {"source": "volume", "path": "../../etc", "volume": {"claimName": "a"}}}, "model.path"),
    ({"model": {"path": "x.gguf"}}, "embedded model needs neither"),
    ({"model": {"source": "s3", "s3": {"bucket": "m", "prefix": "gguf/smol.Q8_0.gguf"}}},
     'set model.path="smol.Q8_0.gguf"'),
    ({"adapterStore": {"blobs": "s3"}}, "adapterStore.s3.bucket"),
    ({"redis": {"mode": "external"}}, "redis.external.url"),
    ({"redis": {"mode": "external", "external": {"url": "http://redis:6379"}}}, "redis://"),
    ({"server": {"defaultMaxNewTokens": 5000}}, "maxNewTokensLimit"),
    ({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}, **SHARED_REDIS,
      "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) is above"),
    ({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}, **SHARED_REDIS,
      "autoscaling": {"enabled": True, "customMetric": {"enabled": False}, "cpuTargetUtilization": None}},
     "needs a metric"),
    ({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}, "replicaCount": 2}, "set redis.mode=external"),
    ({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}, "autoscaling": {"enabled": True}},
     "each pod its own in-memory index"),
])
def test_chart_refuses_inconsistent_values_with_a_message(values: dict, words: str) -> None:
    assert words in render_error(values)


@pytest.mark.parametrize("count", [2, 8])
def test_more_gpus_than_the_server_uses_are_refused_naming_the_value(count: int) -> None:
    """gpu.count became the pod's GPU limit while the server ran on one of them: the others were
    held on the node and never used."""
    message = render_error({"gpu": {"count": count}})
    assert f"gpu.count={count}" in message and "one GPU" in message and "gpu.count=1" in message, message


def test_the_rendered_server_shards_over_no_more_gpus_than_the_pod_holds() -> None:
    r = render()
    settings = ServerSettings.from_sources([], server_env(r))  # LORAPLEX_TENSOR_PARALLEL unset: one GPU
    assert settings.tensor_parallel == 1 == r.container("server")["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("url", [
    "redis://app:s3cr3tpw@redis:6379/0",
    "redis://:s3cr3tpw@redis:6379/0",
    "redis://redis:6379/0?password=s3cr3tpw",  # redis-py's from_url reads the query parameter
    "rediss://app@redis:6380/0?socket_timeout=5&password=s3cr3tpw",
    "redis://redis:6379/0?PASSWORD=s3cr3tpw",
    "redis://redis:6379/0?ssl_password=s3cr3tpw",
    "redis://redis:6379/0?pass%77ord=s3cr3tpw",  # parse_qs unescapes keys: "password"
    "unix:///run/redis.sock?db=0&password=s3cr3tpw",
])
def test_redis_url_with_a_password_is_refused_without_echoing_it(url: str) -> None:
    """A password in the URL would sit in plain text in the store's ConfigMap."""
    message = render_error({"redis": {"mode": "external", "external": {"url": url}}})
    assert "carries a password" in message and "redis.external.existingSecret" in message
    assert "s3cr3tpw" not in message


@pytest.mark.parametrize("url", ["redis://redis.cache:6379/0", "rediss://app@redis:6380/1?socket_timeout=5",
                                 "redis://[::1]:6379/0", "unix:///run/redis.sock?db=2"])
def test_redis_url_without_a_password_reaches_the_store(url: str) -> None:
    r = render({"redis": {"mode": "external", "external": {"url": url}}})
    assert r.config("store")["LORAPLEX_STORE_REDIS_URL"] == url


def test_schema_choices_are_the_servers() -> None:
    assert prop("model", "dtype")["enum"] == list(DTYPES)
    # "dummy" (random weights for benchmarks) is the server's only format the chart leaves out
    assert set(prop("model", "format")["enum"]) == set(MODEL_FORMATS) - {"dummy"}


CONNECTIONS = {"httpHeadTimeoutS": 2.5, "httpBodyTimeoutS": 12, "httpKeepAliveTimeoutS": 0.5,
               "httpMaxConnections": 1_000_000, "httpMaxHeadBytes": 8192, "grpcMaxStreamsPerConnection": 64,
               "grpcMaxConnectionIdleS": 0, "grpcMaxConnectionAgeS": 7200, "grpcMaxConnectionAgeGraceS": 30,
               "grpcKeepaliveTimeS": 45, "grpcKeepaliveTimeoutS": 5, "grpcMinPingIntervalS": 2,
               "grpcPermitKeepaliveWithoutCalls": "on"}


def test_every_connection_bound_of_the_server_is_a_chart_value_and_reaches_it() -> None:
    """server.connections holds exactly the server's http_*/grpc_* bounds (not the ports), null
    keeps the server's defaults, and each value set arrives in the server's settings as given."""
    settings_fields = {f for f in ServerSettings.__dataclass_fields__
                       if f.startswith(("http_", "grpc_"))} - {"http_port", "http_cors_origins"}  # not bounds
    chart_keys = set(prop("server", "connections")["properties"])
    assert chart_keys == set(CONNECTIONS)
    assert {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower() for k in chart_keys} == settings_fields
    default = ServerSettings.from_sources([], server_env(render()))
    assert all(getattr(default, f) == ServerSettings.__dataclass_fields__[f].default for f in settings_fields)
    configured = ServerSettings.from_sources([], server_env(render({"server": {"connections": CONNECTIONS}})))
    for key, value in CONNECTIONS.items():
        assert getattr(configured, re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()) == value, key


def test_cors_origins_reach_the_server_and_are_off_by_default() -> None:
    assert "LORAPLEX_HTTP_CORS_ORIGINS" not in server_env(render())
    assert ServerSettings.from_sources([], server_env(render())).http_cors_origins is None
    origins = "https://ui.example.com,https://b.example"
    env = server_env(render({"server": {"httpCorsOrigins": origins}}))
    assert ServerSettings.from_sources([], env).http_cors_origins == origins


@pytest.mark.parametrize("name", ["values", *CI_VALUE_SETS])
def test_shipped_values_files_satisfy_the_schema(name: str) -> None:
    """A second, independent validator (jsonschema) over the same schema and files."""
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    path = CHART / ("values.yaml" if name == "values" else f"ci/{name}-values.yaml")
    errors = [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(
        yaml.safe_load(path.read_text()))]
    assert not errors


def test_every_default_value_is_described_in_the_schema() -> None:
    """README.md's values table is generated from the schema: no value may go undocumented."""
    def walk(values: dict, schema: dict, path: str) -> list[str]:
        missing = []
        for key, value in values.items():
            sub = schema.get("properties", {}).get(key)
            if sub is None or not sub.get("description"):
                missing.append(f"{path}{key}")
            elif isinstance(value, dict) and sub.get("properties"):
                missing += walk(value, sub, f"{path}{key}.")
        return missing

    assert walk(yaml.safe_load((CHART / "values.yaml").read_text()), SCHEMA, "") == []



def test_readme_values_table_is_generated_from_the_current_schema() -> None:
    import runpy  # noqa: PLC0415

    tool = runpy.run_path(str(CHART.parents[1] / "scripts" / "chart_values_table.py"))
    readme = (CHART / "README.md").read_text()
    assert tool["with_table"](readme) == readme, "run: python scripts/chart_values_table.py"
    for name in ("model.dtype", "redis.mode", "server.drainSeconds", "s3.credentials.existingSecret"):
        assert f"| `{name}` |" in readme


def test_readme_value_examples_install() -> None:
    """Every values file shown in the chart's README renders (schema and chart checks pass)."""
    readme = (CHART / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    examples = [yaml.safe_load(b) for b in blocks if b.startswith("# ") and "-values.yaml" in b.splitlines()[0]]
    assert len(examples) == 4  # my-values, prod-values, gitops-values, metrics-values
    for values in examples:
        rendered = render(values)
        assert rendered.get("Deployment")
