"""A connection refused for its transport names the fix: a plaintext client on a TLS port used
to get only ``UNAVAILABLE ... Socket closed``; now the clients and the CLI say "this port speaks
TLS: pass --tls-root-cert", and the reverse, and when the certificate is not trusted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_helpers import FakeEngine, ServerThread
from tls_helpers import make_tls_files

from loraplex.clients import (
    AsyncLoraplexClient,
    ClientClosedError,
    LoraplexClient,
    LoraplexClientError,
    TlsConfig,
    TransportMismatchError,
    UnavailableError,
)
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
def mtls(tmp_path_factory, pki):
    """A server that requires client certificates signed by ``pki``'s CA."""
    server = ServerThread(ServerOptions(port=0), security=Security(tls=TlsFiles(
        str(pki.server_cert), str(pki.server_key), client_ca=str(pki.ca))))
    server.attach(FakeEngine(tmp_path_factory.mktemp("mtls-adapters")))
    yield server
    server.close()


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


def test_a_client_without_a_certificate_on_a_mutual_tls_port_is_told_to_pass_one(mtls, pki) -> None:
    """It used to get only ``Socket closed``, and ``health --wait`` waited out its whole time."""
    with LoraplexClient(mtls.address, timeout=5, retry_attempts=1, tls=TlsConfig(str(pki.ca))) as client:
        with pytest.raises(TransportMismatchError, match="requires a client certificate.*--tls-client-cert"):
            client.server_info()
        started = time.monotonic()
        with pytest.raises(TransportMismatchError, match="requires a client certificate"):
            client.wait_until_serving(60)
        assert time.monotonic() - started < 30
    with LoraplexClient(mtls.address, timeout=5, retry_attempts=1,
                        tls=TlsConfig(str(pki.ca), str(pki.client_cert), str(pki.client_key))) as client:
        assert client.health() == "SERVING"


def test_a_client_certificate_the_server_does_not_trust_is_named(mtls, pki, tmp_path) -> None:
    stranger = make_tls_files(tmp_path)
    tls = TlsConfig(str(pki.ca), str(stranger.client_cert), str(stranger.client_key))
    with LoraplexClient(mtls.address, timeout=5, retry_attempts=1, tls=tls) as client:
        with pytest.raises(TransportMismatchError, match="refused this client's certificate"):
            client.list_adapters()


def test_a_client_key_of_another_certificate_is_named_before_any_call(mtls, pki, tmp_path) -> None:
    """gRPC logged six lines about a handshaker it could not create, then said only that."""
    other = make_tls_files(tmp_path)
    tls = TlsConfig(str(pki.ca), str(pki.client_cert), str(other.client_key))
    with pytest.raises(ValueError, match=f"TLS client key {other.client_key} is not the key of the client certificate"):
        LoraplexClient(mtls.address, timeout=5, retry_attempts=1, tls=tls)


def test_the_cli_says_one_line_on_a_failed_handshake(servers, tmp_path) -> None:
    """gRPC's own log lines (``Handshake failed``) came before the CLI's one line."""
    tls, _ = servers
    other_ca = make_tls_files(tmp_path).ca
    proc = subprocess.run([sys.executable, "-P", "-m", "loraplex.clients.cli", "--address", tls.address,
                           "--tls-root-cert", str(other_ca), "--timeout", "5", "info"],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [line for line in proc.stderr.strip().splitlines()
                                                if line.startswith("loraplex: ")], proc.stderr
    assert "not one this client trusts" in proc.stderr


def test_a_closed_client_says_so_at_once(servers) -> None:
    """A call after close() raised gRPC's ValueError; wait_until_serving spun for its whole timeout."""
    _, plain = servers
    client = LoraplexClient(plain.address, timeout=5)
    client.close()
    with pytest.raises(ClientClosedError, match="closed"):
        client.list_adapters()
    with pytest.raises(ClientClosedError):
        client.generate("hi")
    started = time.monotonic()
    with pytest.raises(ClientClosedError):
        client.wait_until_serving(60)
    assert time.monotonic() - started < 5

    async def closed_async() -> None:
        async_client = AsyncLoraplexClient(plain.address, timeout=5)
        await async_client.close()
        with pytest.raises(ClientClosedError):
            await async_client.server_info()
        with pytest.raises(ClientClosedError):
            await async_client.wait_until_serving(60)

    asyncio.run(closed_async())


@pytest.fixture
def http_port():
    """A plain HTTP server's address (an HTTP/1.1 port such as the server's --http-port)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def health_only_port():
    """A gRPC server with the health service only (as the adapter store's port looks to this client)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_an_http_port_is_named_and_not_waited_for(http_port, capsys) -> None:
    """The HTTP port (--http-port) answered with gRPC's "Failed parsing HTTP/2 ... frame type 80",
    and `health --wait` waited out its whole time, then said only DEADLINE_EXCEEDED."""
    with LoraplexClient(http_port, timeout=5) as client:
        with pytest.raises(TransportMismatchError, match="this port does not speak gRPC"):
            client.server_info()
        started = time.monotonic()
        with pytest.raises(TransportMismatchError):
            client.wait_until_serving(30)
        assert time.monotonic() - started < 10
    assert cli_main(["--address", http_port, "health", "--wait", "30"]) == 1
    assert "this port does not speak gRPC" in capsys.readouterr().err


def test_a_grpc_port_without_the_inference_service_is_named(health_only_port, capsys) -> None:
    """The adapter store's port (or any other gRPC service) answered "UNIMPLEMENTED: Method not found!"."""
    assert cli_main(["--address", health_only_port, "--timeout", "5", "info"]) == 1
    err = capsys.readouterr().err
    assert "serves no loraplex.v1.InferenceService" in err and "--port" in err, err

    async def call() -> None:
        async with AsyncLoraplexClient(health_only_port, timeout=5) as client:
            await client.list_adapters()

    with pytest.raises(LoraplexClientError, match="serves no loraplex.v1.InferenceService"):
        asyncio.run(call())


def test_health_asks_for_the_inference_service(health_only_port, capsys) -> None:
    """`loraplex health` and wait_until_serving asked for the whole server's health (""), which the
    adapter store's port answers SERVING too: a script waited for the store and then failed its calls."""
    assert cli_main(["--address", health_only_port, "--timeout", "5", "health"]) == 1
    out = capsys.readouterr()
    assert out.out == "SERVICE_UNKNOWN\n" and "serves no loraplex.v1.InferenceService" in out.err
    assert cli_main(["--address", health_only_port, "health", "--wait", "30"]) == 1
    assert "serves no loraplex.v1.InferenceService" in capsys.readouterr().err
    with LoraplexClient(health_only_port, timeout=5) as client:
        assert client.health() == "SERVING"
        assert client.health("loraplex.v1.InferenceService") == "SERVICE_UNKNOWN"
        started = time.monotonic()
        with pytest.raises(LoraplexClientError, match="serves no loraplex.v1.InferenceService"):
            client.wait_until_serving(30)
        assert time.monotonic() - started < 5

    async def wait() -> None:
        async with AsyncLoraplexClient(health_only_port, timeout=5) as client:
            await client.wait_until_serving(30)

    with pytest.raises(LoraplexClientError, match="serves no loraplex.v1.InferenceService"):
        asyncio.run(wait())
