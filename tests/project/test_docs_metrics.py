"""Every metric name the docs mention is one a running process exports, under that name.

The docs (README.md, docs/*.md, helm/loraplex/README.md) name metrics for dashboards, alerts
and the HPA; a name that is not exported silently matches nothing. The server is started as a
real process on the tiny Llama, with authentication off and with tokens, serves a generation,
refuses a bad token, and is scraped on its metrics port and its HTTP port; the store sidecar is
scraped for the loraplex_store_* names. A counter is matched by its exposed sample name
(`loraplex_auth_failures_total`, never the bare `loraplex_auth_failures`), a gauge or histogram
by its name; `loraplex_tenant_*` stands for any name with that prefix. The other way round,
docs/METRICS.md has a row for every metric the scrapes find, with its type and labels.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from doc_sources import doc_files, rel
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import free_port
from store_services import StoreProcess
from server_process import REPO, start_server, stop

from loraplex.clients import LoraplexClient, UnauthenticatedError
from loraplex.inference_server.auth.tokens import hash_token

pytestmark = pytest.mark.slow
METRIC = re.compile(r"(?<![\w:])(loraplex_[a-z0-9_]+\*?|vllm:[a-z_]+)")
TOKEN = "docs-metrics-token-0123456789"


def documented_metrics() -> dict[str, list[str]]:
    """{metric name or prefix*: [where the docs name it]}."""
    found: dict[str, list[str]] = {}
    for doc in doc_files():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in METRIC.finditer(line):
                found.setdefault(m[1], []).append(f"{rel(doc)}:{n}")
    return found


def exported_names(text: str) -> set[str]:
    """The names a scrape answers to: every sample's name, a counter's <name>_total (declared,
    even before its first labelled series), and the name of every other metric (a gauge, a
    histogram). A counter's bare name is not one: a query for it finds nothing."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """name as queried (a counter's with _total) -> (type, the label names on its samples)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus_client's creation times, beside each counter
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, {k for s in family.samples for k in s.labels if k not in ("le", "quantile")})
    return out


def reference_rows(section: str) -> dict[str, tuple[str, set[str]]]:
    """docs/METRICS.md's table under '## <Section>: ...': {name: (type, labels)}."""
    rows: dict[str, tuple[str, set[str]]] = {}
    inside = False
    for line in (REPO / "docs" / "METRICS.md").read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].lower().startswith(f"{section}:")
        elif inside and line.startswith("| `"):
            name, kind, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
            rows[name.strip("`")] = (kind, {label.strip() for label in labels.split(",") if label.strip()})
    return rows


def check_reference(section: str, exported: dict[str, tuple[str, set[str]]]) -> None:
    """docs/METRICS.md, the operators' reference, has a row for every metric exported, with its type
    and labels, and none for a metric that is gone."""
    rows = reference_rows(section)
    assert sorted(set(exported) - set(rows)) == [], f"exported, no row in docs/METRICS.md's {section} table"
    assert sorted(set(rows) - set(exported)) == [], f"a row in docs/METRICS.md's {section} table, not exported"
    for name, (kind, labels) in exported.items():
        assert rows[name][0] == kind, f"{name}: docs/METRICS.md says {rows[name][0]}, exported as {kind}"
        assert labels <= rows[name][1], f"{name}: labels {sorted(labels - rows[name][1])} not in docs/METRICS.md"


def missing(documented: dict[str, list[str]], names: set[str]) -> list[str]:
    out = []
    for name, where in sorted(documented.items()):
        ok = any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names
        if not ok:
            out.append(f"{name} ({', '.join(where)})")
    return out


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _serve_and_scrape(tiny_llama_dir: Path, tmp_path: Path, auth: bool) -> tuple[str, str]:
    """(metrics port scrape, HTTP port scrape) of a server that generated once (and, with auth,
    refused a bad token on both ports)."""
    metrics_port, http_port = free_port(), free_port()
    extra = ["--metrics-port", str(metrics_port), "--http-port", str(http_port)]
    token = None
    if auth:
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [{"sha256": hash_token(TOKEN), "tenant": "acme", "role": "admin"}]}))
        extra += ["--auth", "tokens", "--tokens-file", str(tokens)]
        token = TOKEN
    proc, address = start_server(tiny_llama_dir, tmp_path, *extra)
    try:
        with LoraplexClient(address, timeout=10, token=token) as client:
            client.wait_until_serving(240)
            assert client.generate_text("Hello", max_new_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        if auth:
            with LoraplexClient(address, timeout=10, token="not-a-token-0123456789") as intruder, \
                    pytest.raises(UnauthenticatedError):
                intruder.list_adapters()
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/models",
                                             headers={"Authorization": "Bearer not-a-token-0123456789"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401
        time.sleep(0.2)
        return (_scrape(f"http://127.0.0.1:{metrics_port}/metrics"),
                _scrape(f"http://127.0.0.1:{http_port}/metrics"))
    finally:
        stop(proc)


def test_the_docs_name_metrics_and_those_names_are_checked() -> None:
    names = documented_metrics()
    assert {"loraplex_queue_length", "vllm:num_requests_waiting"} <= set(names), sorted(names)
    assert exported_names("# TYPE a counter\na_total 1\n# TYPE b gauge\nb 2\n# TYPE c counter\n") == {
        "a_total", "b", "c_total"}


@pytest.mark.parametrize("auth", [False, True], ids=["auth-off", "auth-tokens"])
def test_every_documented_server_metric_is_exported(tiny_llama_dir: Path, tmp_path: Path, auth: bool) -> None:
    documented = {n: w for n, w in documented_metrics().items() if not n.startswith("loraplex_store_")}
    on_metrics_port, on_http_port = _serve_and_scrape(tiny_llama_dir, tmp_path, auth)
    gone = missing(documented, exported_names(on_metrics_port))
    assert not gone, "documented, not exported on --metrics-port:\n" + "\n".join(gone)
    gone = missing(documented, exported_names(on_http_port))
    assert not gone, "documented, not exported on the HTTP port's /metrics:\n" + "\n".join(gone)
    assert families(on_http_port).keys() == families(on_metrics_port).keys()
    check_reference("server", families(on_metrics_port))


def test_every_documented_store_metric_is_exported(tmp_path: Path) -> None:
    documented = {n: w for n, w in documented_metrics().items() if n.startswith("loraplex_store_")}
    port = free_port()
    store = StoreProcess(["--local-dir", str(tmp_path / "blobs"), "--metrics-port", str(port)], tmp_path / "store.log")
    try:
        scraped = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        store.stop()
    gone = missing(documented, exported_names(scraped))
    check_reference("store", families(scraped))
    assert not gone, "documented, not exported by loraplex-store:\n" + "\n".join(gone)
