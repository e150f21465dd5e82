"""A connection refused for its transport names the fix: a plaintext client on a TLS port used
to get only ``UNAVAILABLE ... Socket closed``; now the clients and the CLI say "this port speaks
TLS: pass --tls-root-cert", and the reverse, and when the certificate is not trusted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import FakeEngine, ServerThread
from tls_helpers import make_tls_files

from loraplex.clients import AsyncLoraplexClient, LoraplexClient, TlsConfig, TransportMismatchError, UnavailableError
from loraplex.clients.cli import main as cli_main
from loraplex.clients.transport import speaks_tls
from loraplex.inference_server.auth.security import Security, TlsFiles
from loraplex.inference_server.server.app import ServerOptions

pytestmark = pytest.mark.slow  # starts servers
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, pki):
    """(a TLS server, a plaintext server) over fake engines."""
    folder = tmp_path_factory.mktemp("adapters")
    tls = ServerThread(ServerOptions(port=0), security=Security(tls=TlsFiles(str(pki.server_cert),
                                                                             str(pki.server_key))))
    tls.attach(FakeEngine(folder / "tls"))
    plain = ServerThread(ServerOptions(port=0, default_max_new_tokens=200))
    plain.attach(FakeEngine(folder / "plain"))
    yield tls, plain
    tls.close()
    plain.close()


def test_the_probe_tells_a_tls_port_from_a_plaintext_one(servers) -> None:
    tls, plain = servers
    assert speaks_tls(tls.address) is True
    assert speaks_tls(plain.address) is False
    assert speaks_tls("unix:/tmp/nothing") is None


def test_a_plaintext_client_on_a_tls_port_is_told_to_pass_the_root_cert(servers) -> None:
    tls, _ = servers
    with LoraplexClient(tls.address, timeout=5, retry_attempts=1) as client:
        with pytest.raises(TransportMismatchError, match="this port speaks TLS: pass --tls-root-cert") as info:
            client.server_info()
        assert isinstance(info.value, UnavailableError) and "Socket closed" in str(info.value)
        started = time.monotonic()
        with pytest.raises(TransportMismatchError):
            client.wait_until_serving(60)  # no point waiting a minute for the wrong transport
        assert time.monotonic() - started < 30


def test_a_tls_client_on_a_plaintext_port_is_told_to_drop_tls(servers, pki) -> None:
    _, plain = servers
    with LoraplexClient(plain.address, timeout=5, retry_attempts=1, tls=TlsConfig(str(pki.ca))) as client:
        with pytest.raises(TransportMismatchError, match="this port speaks plaintext gRPC, not TLS"):
            client.list_adapters()
        with pytest.raises(TransportMismatchError, match="plaintext"):
            list(client.generate("hi", max_new_tokens=2))


def test_an_untrusted_certificate_is_named(servers, tmp_path) -> None:
    tls, _ = servers
    other_ca = make_tls_files(tmp_path).ca
    with LoraplexClient(tls.address, timeout=5, retry_attempts=1, tls=TlsConfig(str(other_ca))) as client:
        with pytest.raises(TransportMismatchError, match="not one this client trusts"):
            client.server_info()


def test_the_async_client_names_the_fix_too(servers) -> None:
    tls, _ = servers

    async def call() -> None:
        async with AsyncLoraplexClient(tls.address, timeout=5, retry_attempts=1) as client:
            await client.server_info()

    with pytest.raises(TransportMismatchError, match="this port speaks TLS"):
        asyncio.run(call())


def test_the_cli_names_the_fix(servers, pki, capsys) -> None:
    tls, plain = servers
    assert cli_main(["--address", tls.address, "--timeout", "5", "health"]) == 1
    assert "this port speaks TLS: pass --tls-root-cert" in capsys.readouterr().err
    assert cli_main(["--address", plain.address, "--tls-root-cert", str(pki.ca), "--timeout", "5", "info"]) == 1
    assert "this port speaks plaintext gRPC" in capsys.readouterr().err
    assert cli_main(["--address", tls.address, "--tls-root-cert", str(pki.ca), "health"]) == 0


def test_the_cli_ends_quietly_when_its_reader_leaves(servers) -> None:
    """`loraplex generate --json ... | head -1` used to end with `[Errno 32] Broken pipe`."""
    _, plain = servers
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "loraplex.clients.cli", "--address", plain.address, "generate", "--json",
         "--raw", "a long story", "--max-new-tokens", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    _, err = proc.communicate(timeout=60)
    assert first.startswith(b"{"), (first, err)
    assert proc.returncode == 0, err
    assert b"Broken pipe" not in err and b"Errno 32" not in err and b"Traceback" not in err, err


def test_a_tls_file_that_is_no_pem_is_named_before_any_call(servers, tmp_path) -> None:
    tls, _ = servers
    not_pem = tmp_path / "hostname"
    not_pem.write_text("build-host-7\n")  # e.g. /etc/hostname passed by mistake: gRPC said only "handshaker"
    with pytest.raises(ValueError, match=f"TLS root certificate {not_pem}: not a PEM file"):
        LoraplexClient(tls.address, timeout=5, retry_attempts=1, tls=TlsConfig(str(not_pem)))
