"""TLS on the public port with a CA made in the test: round trip, plaintext refused, mutual TLS."""

from __future__ import annotations

import json

import pytest
from server_helpers import FakeEngine, ServerThread, free_port
from tls_helpers import make_tls_files

from loraplex.clients import LoraplexClient, LoraplexClientError, TlsConfig, UnavailableError
from loraplex.clients.cli import main as cli_main
from loraplex.inference_server.auth.security import Security, TlsFiles
from loraplex.inference_server.auth.tokens import TokenFile, hash_token
from loraplex.inference_server.server.app import ServerOptions
from loraplex.inference_server.settings import ServerSettings

pytestmark = pytest.mark.slow  # starts servers
TOKEN = "token-tenant-a-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("pki"))


def _serve(tmp_path, security: Security, **options) -> ServerThread:
    srv = ServerThread(ServerOptions(port=0, **options), security=security)
    srv.attach(FakeEngine(tmp_path / "adapters"))
    return srv


def test_tls_round_trip_and_plaintext_refused(tmp_path, pki, capsys) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"sha256": hash_token(TOKEN), "tenant": "a", "role": "tenant"}]}))
    security = Security(tokens=TokenFile(str(tokens)), tls=TlsFiles(str(pki.server_cert), str(pki.server_key)))
    srv = _serve(tmp_path, security, health_port=free_port())
    try:
        with LoraplexClient(srv.address, timeout=10, retry_attempts=1, token=TOKEN,
                            tls=TlsConfig(root_cert_file=str(pki.ca))) as secure:
            assert secure.generate_text("hi", max_new_tokens=3).usage.completion_tokens == 3
        with LoraplexClient(srv.address, timeout=3, retry_attempts=1, token=TOKEN) as plaintext:
            with pytest.raises(UnavailableError):
                plaintext.server_info()
        rc = cli_main(["--address", srv.address, "--token", TOKEN, "--tls-root-cert", str(pki.ca), "info"])
        assert rc == 0 and json.loads(capsys.readouterr().out)["model_name"] == "fake-llama"
        rc = cli_main(["--address", srv.address, "--tls-root-cert", str(pki.ca), "info"])
        assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
        # the kubelet's plaintext gRPC probe reaches health (only health) on the health port
        with LoraplexClient(f"127.0.0.1:{srv.server.health_port}", timeout=5, retry_attempts=1) as probe:
            assert probe.health() == "SERVING"
            with pytest.raises(LoraplexClientError, match="UNIMPLEMENTED"):
                probe.list_adapters()
    finally:
        srv.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, pki) -> None:
    tls = TlsFiles(str(pki.server_cert), str(pki.server_key), client_ca=str(pki.ca))
    srv = _serve(tmp_path, Security(tls=tls))
    try:
        with LoraplexClient(srv.address, timeout=3, retry_attempts=1, tls=TlsConfig(str(pki.ca))) as no_cert:
            with pytest.raises(UnavailableError):
                no_cert.server_info()
        with_cert = TlsConfig(str(pki.ca), client_cert_file=str(pki.client_cert), client_key_file=str(pki.client_key))
        with LoraplexClient(srv.address, timeout=10, retry_attempts=1, tls=with_cert) as ok:
            assert ok.server_info().model_name == "fake-llama"
    finally:
        srv.close()


def test_tls_settings_are_checked_before_the_port_opens(tmp_path, pki) -> None:
    with pytest.raises(ValueError, match="both --tls-cert-file and --tls-key-file"):
        ServerSettings.from_sources(["--tls-cert-file", str(pki.server_cert)], {})
    with pytest.raises(ValueError, match="client certificates need server TLS"):
        ServerSettings.from_sources(["--tls-client-ca-file", str(pki.ca)], {})
    settings = ServerSettings.from_sources(["--tls-cert-file", str(pki.server_cert),
                                            "--tls-key-file", str(tmp_path / "missing.pem")], {})
    with pytest.raises(ValueError, match="TLS key file .*missing.pem: cannot read"):
        Security.from_settings(settings)
    with pytest.raises(ValueError, match="a client certificate needs its key"):
        TlsConfig(client_cert_file=str(pki.client_cert))
    with pytest.raises(ValueError, match="--auth tokens needs a tokens file"):
        ServerSettings.from_sources(["--auth", "tokens"], {})
