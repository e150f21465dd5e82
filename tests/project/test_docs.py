"""The docs cannot drift from the code: every loraplex, loraplex-server and loraplex-store
command of README.md, docs/*.md and helm/loraplex/README.md parses with that program's own
parser (systemd units' ExecStart lines too); every flag, LORAPLEX_* variable and chart values
key they name exists; every Helm command and values example of the chart renders (with the
--api-versions the doc gives), and what the docs say about the chart's Service, NetworkPolicy
and replicas matches what it renders and refuses. The metric names are checked against
running processes in test_docs_metrics.py."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from doc_sources import REPO, Command, doc_files, documented_commands, inline_spans, prose, rel, values_examples
from helm_chart_helpers import CHART, render, render_error

from loraplex.adapter_store.main import _parser as store_parser
from loraplex.clients.cli import build_parser as cli_parser
from loraplex.clients.security import TLS_ENV, TOKEN_ENV
from loraplex.inference_server.settings import ENV_PREFIX, ServerSettings, build_parser
from doc_commands import command_failure

DOCS = doc_files()
OUR_CHART = "helm/loraplex"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# Inline code that looks like a values key but names a file or a Secret's data key.
NOT_VALUES_KEYS = ("tls.crt", "tls.key", "ca.crt")
FILE_SUFFIXES = ("py", "crt", "key", "json", "yaml", "yml", "pem", "txt", "md", "proto", "tpl", "gguf", "safetensors")
# Inline code starting with another program: its flags are that program's.
OTHER_PROGRAMS = ("helm", "kubectl", "docker", "grpcurl", "pip", "make", "pytest", "openssl", "systemctl", "curl",
                  "git", "python")
HELM_VALUE_OPTIONS = ("-f", "--values", "--set", "--set-string", "--api-versions", "--kube-version", "-n",
                      "--namespace", "--version")
# API versions a values example needs for what it turns on (the chart renders it only where the API exists).
NEEDS_API = {"inferencePool": ("inference.networking.k8s.io/v1", "InferencePool"),
             "serviceMonitor": ("monitoring.coreos.com/v1", "ServiceMonitor")}


def _ids(paths: list[Path]) -> list[str]:
    return [rel(p) for p in paths]


# --------------------------------------------------------------------------- commands and flags


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_documented_command_parses(doc: Path) -> None:
    failures = [f"{c}\n    -> {why}" for c in documented_commands(doc) if (why := command_failure(c))]
    assert not failures, "commands the parsers refuse:\n" + "\n".join(failures)


def _parser_flags(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:  # noqa: SLF001  (argparse has no public walk)
        yield from (o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                yield from _parser_flags(sub)


def known_flags() -> set[str]:
    """Every --flag of loraplex-server, loraplex-store, the loraplex CLI, and the benchmark,
    demo and script command lines (read from their add_argument calls, nothing imported)."""
    flags = set(_parser_flags(build_parser())) | set(_parser_flags(store_parser({}))) | set(_parser_flags(cli_parser()))
    for folder in ("benchmarks", "demo", "scripts"):
        for source in (REPO / folder).rglob("*.py"):
            flags |= set(re.findall(r"add_argument\(\s*['\"](--[a-z0-9-]+)['\"]", source.read_text()))
    return flags


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_flag_in_the_prose_exists(doc: Path) -> None:
    """Inline code such as `--model-format dummy` (docs/PERFORMANCE.md said `--load-format`)."""
    known = known_flags()
    unknown = []
    for where, span in inline_spans(doc):
        words = span.split()
        if words[0] in OTHER_PROGRAMS:
            continue
        for word in words:
            flag = word.strip("[]()`,.;").split("=", 1)[0]
            if flag.startswith("--") and len(flag) > 2 and flag not in known:
                unknown.append(f"{where}: {flag} (in `{span}`)")
    assert not unknown, "flags no parser has:\n" + "\n".join(unknown)


def known_variables() -> set[str]:
    server = {ENV_PREFIX + name.upper() for name in ServerSettings.__dataclass_fields__}
    store = {f"LORAPLEX_STORE_{o[2:].upper().replace('-', '_')}" for o in _parser_flags(store_parser({}))
             if o != "--help"}
    return server | store | {TOKEN_ENV, "LORAPLEX_ADDRESS", *TLS_ENV.values()}


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_loraplex_variable_exists(doc: Path) -> None:
    known = known_variables()
    text = doc.read_text()
    found = {m[0] for m in re.finditer(r"\bLORAPLEX_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*<])", text)}
    assert not found - known, f"{rel(doc)} names variables nothing reads: {sorted(found - known)}"


# --------------------------------------------------------------------------- the chart's values

def _value_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield path, value
            yield from _value_paths(value, path + ".")


VALUE_PATHS = dict(_value_paths(VALUES))


def values_key_problem(key: str) -> str | None:
    """None if ``key`` (a.b.c, list indexes dropped) is a value of the chart or sits under a
    free-form map value (nodeSelector, podLabels, ...), else why not."""
    key = re.sub(r"\[\d+\]", "", key)
    if key in VALUE_PATHS:
        return None
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:n])
        if head in VALUE_PATHS:
            default = VALUE_PATHS[head]
            return None if default == {} else f"{head} has no key {parts[n]!r}"
    return f"{parts[0]!r} is not a value of the chart"


def _set_pairs(text: str) -> Iterator[tuple[str, str]]:
    for pair in re.split(r"(?<!\\),", text):
        key, _, value = pair.partition("=")
        yield key, value


def _set_into(values: dict, key: str, value: str) -> None:
    node = values
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = yaml.safe_load(value) if value else ""


def _deep_merge(into: dict, more: dict) -> dict:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def helm_commands(doc: Path) -> list[Command]:
    """The doc's `helm` commands of this chart: its shell blocks' and its inline code's."""
    from doc_sources import split_commands  # noqa: PLC0415

    inline = [c for where, span in inline_spans(doc) if span.startswith("helm ") for c in split_commands(span, where)]
    return [c for c in documented_commands(doc) + inline if c.program == "helm" and len(c.args) > 1 and _our_chart(c)]


def _our_chart(command: Command) -> bool:
    """A helm install/upgrade/template of helm/loraplex (``...`` standing for the rest counts)."""
    if command.args[:1] not in (("install",), ("upgrade",), ("template",)):
        return False
    positional, args = [], iter(command.args[1:])
    for arg in args:
        if arg in HELM_VALUE_OPTIONS:
            next(args, None)
        elif not arg.startswith("-"):
            positional.append(arg)
    return len(positional) < 2 or OUR_CHART in positional or "..." in positional


def _option_values(args: tuple[str, ...], *names: str) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                out.append(args[i + 1])
            elif arg.startswith(name + "="):
                out.append(arg.split("=", 1)[1])
    return out


def api_versions(doc: Path) -> tuple[str, ...]:
    return tuple(sorted({v for c in helm_commands(doc) for v in _option_values(c.args, "--api-versions")}))


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_helm_command_sets_real_keys_and_renders(doc: Path) -> None:
    examples = values_examples(doc)
    problems = []
    for command in helm_commands(doc):
        values: dict = {}
        for name in _option_values(command.args, "-f", "--values"):
            if name not in examples:
                problems.append(f"{command}: -f {name}, which {rel(doc)} does not show")
                continue
            _deep_merge(values, yaml.safe_load(examples[name].text) or {})
        for setting in _option_values(command.args, "--set", "--set-string"):
            for key, value in _set_pairs(setting):
                if (why := values_key_problem(key)) is not None:
                    problems.append(f"{command}: --set {key}: {why}")
                _set_into(values, key, value)
        if "..." in command.args or problems:
            continue  # a fragment of a command: its keys are checked, the rest is the reader's
        try:
            render(values, api_versions=tuple(_option_values(command.args, "--api-versions")))
        except Exception as exc:  # noqa: BLE001  (HelmError: the message is the finding)
            problems.append(f"{command}: does not render: {str(exc)[:400]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_values_example_renders_with_the_api_versions_the_doc_gives(doc: Path) -> None:
    """docs/HTTP.md's InferencePool example (replicaCount 4, S3 blobs) did not render: the chart
    also needs redis.mode external or bundled for more than one replica."""
    versions = api_versions(doc)
    problems = []
    for name, block in values_examples(doc).items():
        values = yaml.safe_load(block.text) or {}
        try:
            rendered = render(values, api_versions=versions)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{block.where} ({name}): does not render: {str(exc)[:400]}")
            continue
        for key, (api, kind) in NEEDS_API.items():
            if (values.get(key) or {}).get("enabled") and not rendered.all(kind):
                problems.append(f"{block.where} ({name}): enables {key}, but no {kind} renders: give "
                                f"`helm template ... --api-versions {api}` in {rel(doc)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_values_key_in_the_prose_exists(doc: Path) -> None:
    """Inline code such as `adapterStore.blobs=s3` or `server.httpPort`."""
    problems = []
    for where, span in inline_spans(doc):
        m = re.fullmatch(r"([a-z][A-Za-z0-9]*(?:\.[A-Za-z0-9]+)+)(?:=\S*)?", span)
        if m is None or m[1].split(".", 1)[0] not in VALUES or m[1] in NOT_VALUES_KEYS \
                or m[1].rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue
        if (why := values_key_problem(m[1])) is not None:
            problems.append(f"{where}: `{span}`: {why}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- what the docs say about the chart

def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, list items apart."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        out.extend(p for p in re.split(r"\n(?=\s*[-*] )", block) if p.strip())
    return out


def _values_comment_blocks() -> list[str]:
    """values.yaml's comments: each run of comment lines with the value line after it."""
    blocks, current = [], []
    for line in (CHART / "values.yaml").read_text().splitlines():
        current.append(line)
        if not line.lstrip().startswith("#"):
            blocks.append("\n".join(current))
            current = []
    return blocks


def _schema_descriptions(node: dict, path: str = "") -> Iterator[tuple[str, str]]:
    if "description" in node:
        yield path, node["description"]
    for key, sub in node.get("properties", {}).items():
        yield from _schema_descriptions(sub, f"{path}.{key}" if path else key)


def chart_statements() -> list[tuple[str, str]]:
    """(where, text) of everything that describes the chart in words: the docs' prose
    paragraphs, values.yaml's comments, the schema's descriptions, the templates' comments."""
    out = [(rel(doc), p) for doc in DOCS for p in _paragraphs(prose(doc))]
    out += [("helm/loraplex/values.yaml", b) for b in _values_comment_blocks()]
    out += [(f"values.schema.json {path}", d) for path, d in _schema_descriptions(SCHEMA)]
    for template in sorted((CHART / "templates").glob("*.yaml")):
        comments = "\n".join(line for line in template.read_text().splitlines() if line.lstrip().startswith("#"))
        out += [(rel(template), comments)]
    return out


def test_what_the_docs_say_replicas_need_is_what_the_chart_requires() -> None:
    """The HTTP edge docs, the Helm README and values.yaml said adapterStore.blobs=s3 is all more
    than one replica needs; the chart also refuses redis.mode=none (each pod's own index)."""
    refusal = render_error({"replicaCount": 2, "adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}})
    assert "redis.mode" in refusal, refusal  # what the statements below must therefore name
    about_replicas = re.compile(r"replica|autoscal", re.I)
    about_s3_blobs = re.compile(r"blobs ?(=|: ?)s3|S3 blobs", re.I)
    wrong = [f"{where}: {' '.join(text.split())[:300]}" for where, text in chart_statements()
             if about_replicas.search(text) and about_s3_blobs.search(text) and "redis.mode" not in text]
    assert not wrong, "say that more than one replica needs redis.mode external or bundled too:\n" + "\n".join(wrong)


def _states_what_the_policy_admits(text: str) -> bool:
    """A statement of which ports the NetworkPolicy lets in: 'only', a port, and ingress/admits."""
    return all(re.search(pattern, text, re.I) for pattern in (r"\bonly\b", r"\bports?\b", r"ingress|admits"))


def test_what_the_docs_say_the_network_policy_admits_is_what_it_renders() -> None:
    """The Helm README, values.yaml and the schema said the policy admits only the gRPC and
    metrics ports; it also admits `http` and `store-metrics`."""
    policy = render().get("NetworkPolicy")
    ports = sorted({p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]})
    assert ports == ["grpc", "http", "metrics", "store-metrics"], ports
    statements = [(where, text) for where, text in chart_statements() if _states_what_the_policy_admits(text)]
    wheres = {where.split(" ")[0] for where, _ in statements}
    assert {"helm/loraplex/README.md", "helm/loraplex/values.yaml", "values.schema.json",
            "helm/loraplex/templates/networkpolicy.yaml"} <= wheres, wheres
    missing = [f"{where}: {' '.join(text.split())[:300]} (misses {[p for p in ports if not _names_port(text, p)]})"
               for where, text in statements if not all(_names_port(text, p) for p in ports)]
    assert not missing, "name every port the NetworkPolicy admits:\n" + "\n".join(missing)


def _names_port(text: str, port: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(port)}(?![\w-])", text, re.I) is not None


def test_the_service_list_names_every_port_of_the_service() -> None:
    """The Helm README's picture listed the Service's ports without `http`."""
    ports = [p["name"] for p in render().get("Service")["spec"]["ports"]]
    line = next(line for line in (CHART / "README.md").read_text().splitlines()
                if line.startswith("Service <release>-loraplex ("))
    listed = [p.strip() for p in line.split("(", 1)[1].split(")", 1)[0].split(",")]
    assert sorted(listed) == sorted(ports), (listed, ports)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_docs_with_helm_commands_say_helm_is_the_readers(doc: Path) -> None:
    """The project's chart tooling (scripts/install_chart_tools.sh) installs no `helm` command:
    a doc that tells the reader to run helm says they need their own."""
    if any(c.program == "helm" for c in documented_commands(doc)):
        assert "a `helm` binary" in doc.read_text(), f"{rel(doc)} runs helm without saying it needs a `helm` binary"
