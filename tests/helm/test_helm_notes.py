"""The chart's NOTES.txt prints the commands that work for the values given: TLS (the root CA,
client certificates), tokens, the OpenAI-compatible port, the Service type. It used to print
plaintext commands without a token whatever the values, and never the OpenAI port.

Every loraplex command NOTES prints must parse with the CLI's parser, and with TLS, tokens and
the HTTP port on, the printed shell lines (all but kubectl's) are run as written against a real
server (a fake engine) set up as the chart sets it up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_sources import split_commands
from helm_chart_helpers import render
from server_helpers import FakeEngine, ServerThread, free_port, write_fake_adapter
from doc_commands import command_failure
from tls_helpers import make_tls_files

from loraplex.inference_server.auth.security import Security, TlsFiles
from loraplex.inference_server.auth.tokens import TokenFile, hash_token
from loraplex.inference_server.server.app import ServerOptions

TLS = {"tls": {"secretName": "lp-tls"}}
MTLS = {"tls": {"secretName": "lp-tls", "clientCaSecret": "lp-client-ca"}}
TOKENS = {"auth": {"mode": "tokens", "tokensSecret": "lp-tokens"}}
VALUE_SETS = {
    "default": {}, "tls": TLS, "mtls": MTLS, "tokens": TOKENS, "tls-tokens": {**TLS, **TOKENS},
    "no-http": {"server": {"httpPort": 0}}, "nodeport-tls": {**TLS, "service": {"type": "NodePort"}},
    "loadbalancer-tokens": {**TOKENS, "service": {"type": "LoadBalancer", "httpPort": 80}},
}


def command_lines(notes: str) -> list[str]:
    """The lines NOTES tells the reader to run (indented five spaces), in order."""
    return [line.strip() for line in notes.splitlines() if line.startswith("     ") and line.strip()]


def exports(notes: str) -> dict[str, str]:
    """{name: value} of every variable NOTES exports."""
    out = {}
    for line in command_lines(notes):
        if line.startswith("export "):
            for word in line.split("#", 1)[0].split()[1:]:
                name, _, value = word.partition("=")
                out[name] = value
    return out


@pytest.mark.parametrize("name", VALUE_SETS)
def test_notes_print_commands_that_fit_the_values(name: str) -> None:
    values = VALUE_SETS[name]
    notes = render(values).notes
    tls, tokens = "tls" in values, "auth" in values
    http = (values.get("server") or {}).get("httpPort", 8000) != 0
    commands = [c for line in command_lines(notes) for c in split_commands(line, "NOTES") if c.program == "loraplex"]
    assert commands and not [f"{c}: {why}" for c in commands if (why := command_failure(c))]
    env = exports(notes)
    assert "LORAPLEX_ADDRESS" in env
    assert ("LORAPLEX_TLS_ROOT_CERT" in env) == tls
    assert ("LORAPLEX_TLS_CLIENT_CERT" in env and "LORAPLEX_TLS_CLIENT_KEY" in env) == ("clientCaSecret" in values.get(
        "tls", {}))
    assert ("LORAPLEX_TOKEN" in env) == tokens
    assert ("OPENAI_BASE_URL" in env) == http
    if http:
        http_port = str((values.get("service") or {}).get("httpPort", 8000))
        assert env["OPENAI_BASE_URL"].startswith("https://" if tls else "http://")
        curl = next(line for line in command_lines(notes) if line.startswith("curl"))
        assert ("--cacert" in curl) == tls and ("Authorization: Bearer $LORAPLEX_TOKEN" in curl) == tokens
        if values.get("service", {}).get("type", "ClusterIP") == "ClusterIP":
            assert f"{http_port}:{http_port}" in notes and env["OPENAI_BASE_URL"].endswith(f":{http_port}/v1")
    else:
        assert "OpenAI" not in notes
    in_pod = next(c for c in commands if "--address" in c.args)
    if tls:  # the image has no CA of the reader's: the plaintext health port, health only
        assert in_pod.args[-1] == "health" and in_pod.args[1] == "127.0.0.1:50052"
    else:
        assert ("--token" in in_pod.args) == tokens


# kubectl as far as NOTES uses it for a LoadBalancer: `get svc` with -o jsonpath, over the Service in
# $FAKE_SERVICE (simple paths with [index]; a missing key prints nothing, as kubectl does).
FAKE_KUBECTL = r"""#!{python}
import json, os, re, sys
args = sys.argv[1:]
if args[:5] != ["-n", "ml", "get", "svc", "lp-loraplex"] or not args[5].startswith("-o") or len(args) != 7:
    sys.exit(f"fake kubectl: unexpected arguments {{args}}")
svc = json.loads(os.environ["FAKE_SERVICE"])
out = []
for path in re.findall(r"{{([^}}]*)}}", args[6].removeprefix("jsonpath=")):
    node = svc  # kubectl prints nothing for a missing key
    for key, index in re.findall(r"\.(\w+)(?:\[(\d+)\])?", path):
        node = node.get(key) if isinstance(node, dict) else None
        if index and node is not None:
            node = node[int(index)] if int(index) < len(node) else None
    out.append("" if node is None else str(node))
print("".join(out), end="")
"""


@pytest.mark.parametrize(("ingress", "host"), [
    ({"hostname": "a1b2.elb.us-east-1.amazonaws.com"}, "a1b2.elb.us-east-1.amazonaws.com"),  # AWS ELB / NLB
    ({"ip": "203.0.113.7"}, "203.0.113.7"),  # GCE, Azure, MetalLB
    ({"ip": "203.0.113.7", "hostname": "lb.example.com"}, "203.0.113.7"),  # both: either works, the IP is taken
], ids=["hostname", "ip", "both"])
def test_the_load_balancer_address_is_found_by_ip_or_hostname(tmp_path: Path, ingress: dict, host: str) -> None:
    """NOTES read only .status.loadBalancer.ingress[0].ip, which AWS leaves empty (it sets hostname):
    LORAPLEX_ADDRESS came out as ':50051'. The printed lines run here against a kubectl that answers
    -o jsonpath from the Service's status."""
    notes = render({"service": {"type": "LoadBalancer", "httpPort": 80}}).notes
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
    kubectl.chmod(0o755)
    lines = command_lines(notes)
    reach = lines[1:next(i for i, line in enumerate(lines) if line.startswith("loraplex "))]  # after rollout status
    script = "set -e\n" + "\n".join(reach) + '\nprintf "%s|%s" "$LORAPLEX_ADDRESS" "$OPENAI_BASE_URL"'
    env = {"PATH": f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}",
           "FAKE_SERVICE": json.dumps({"status": {"loadBalancer": {"ingress": [ingress]}}})}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (script, out.stderr)
    assert out.stdout == f"{host}:50051|http://{host}:80/v1", (script, out.stdout)


@pytest.mark.slow  # starts a server
def test_the_printed_commands_work_with_tls_tokens_and_the_http_port(tmp_path: Path) -> None:
    """Run NOTES' shell lines as printed (the port-forward stands for a server on those ports)."""
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    grpc_port, http_port = free_port(), free_port()
    notes = render({**TLS, **TOKENS, "service": {"grpcPort": grpc_port, "httpPort": http_port}}).notes
    (tmp_path / "pki").mkdir()
    pki = make_tls_files(tmp_path / "pki")
    token = "notes-token-0123456789abcdef"
    (tmp_path / "acme.token").write_text(token + "\n")
    shutil.copy(pki.ca, tmp_path / "ca.pem")
    write_fake_adapter(tmp_path / "pirate-lora")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"sha256": hash_token(token), "tenant": "acme", "role": "tenant"}]}))
    security = Security(tokens=TokenFile(str(tokens)), tls=TlsFiles(str(pki.server_cert), str(pki.server_key)))
    srv = ServerThread(ServerOptions(port=grpc_port), security=security)
    try:
        srv.start_http(port=http_port)
        srv.attach(FakeEngine(tmp_path / "adapters"))
        script = "set -e\n" + "\n".join(line for line in command_lines(notes) if not line.startswith("kubectl"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "OPENAI_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, (script, out.stdout, out.stderr)
        assert "uploaded acme/pirate" in out.stdout and '"id":"acme/pirate"' in out.stdout.replace(" ", ""), out.stdout
    finally:
        srv.close()
