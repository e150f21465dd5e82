"""``loraplex-server --adapter-store`` checks the store at start: a store that refuses the
server's secret stops the server at once with a message naming ``--adapter-store-secret-file``
(it used to report SERVING, then answer every list and upload with INTERNAL and log a watch
warning every second); a store that does not answer is waited for, NOT_SERVING, with one log
line, then named. Real processes: the store sidecar and the server on the tiny Llama."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from store_services import StoreProcess
from server_process import start_server, stop

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import LoraplexClientError

pytestmark = pytest.mark.slow
SECRET = "store-secret-0123456789abcdef"


@pytest.fixture
def store_with_secret(tmp_path: Path):
    (tmp_path / "store.secret").write_text(SECRET + "\n")
    store = StoreProcess(["--local-dir", str(tmp_path / "blobs"), "--secret-file", str(tmp_path / "store.secret")],
                         tmp_path / "store.log")
    yield store
    store.stop()


def _exit_and_log(proc, tmp_path: Path) -> tuple[int, str]:
    code = proc.wait(300)  # generous: importing torch on a shared CI machine
    return code, (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("secret", [None, "a-different-secret-0123456789"])
def test_a_store_refusing_the_secret_stops_the_server_naming_the_flag(
        tiny_llama_dir: Path, tmp_path: Path, store_with_secret: StoreProcess, secret: str | None) -> None:
    extra = ["--adapter-store", store_with_secret.target]
    if secret is not None:
        (tmp_path / "server.secret").write_text(secret)
        extra += ["--adapter-store-secret-file", str(tmp_path / "server.secret")]
    proc, _ = start_server(tiny_llama_dir, tmp_path, *extra)
    try:
        code, log = _exit_and_log(proc, tmp_path)
        assert code == 1, log
        assert "cannot start: the adapter store at " in log and "UNAUTHENTICATED" in log, log
        assert "--adapter-store-secret-file" in log and "LORAPLEX_ADAPTER_STORE_SECRET_FILE" in log, log
        assert "loading the model" not in log, "the check comes before the model loads"
        assert SECRET not in log and (secret is None or secret not in log), "a secret must never be logged"
    finally:
        stop(proc)


def test_the_right_secret_serves(tiny_llama_dir: Path, tmp_path: Path, store_with_secret: StoreProcess) -> None:
    (tmp_path / "server.secret").write_text(SECRET)
    proc, address = start_server(tiny_llama_dir, tmp_path, "--adapter-store", store_with_secret.target,
                                 "--adapter-store-secret-file", str(tmp_path / "server.secret"))
    try:
        with LoraplexClient(address, timeout=10) as client:
            client.wait_until_serving(240)
            assert client.list_adapters() == []
        assert "accepts the shared secret" in (tmp_path / "server.log").read_text()
    finally:
        stop(proc)


def test_an_unreadable_secret_file_is_named(tiny_llama_dir: Path, tmp_path: Path,
                                            store_with_secret: StoreProcess) -> None:
    proc, _ = start_server(tiny_llama_dir, tmp_path, "--adapter-store", store_with_secret.target,
                           "--adapter-store-secret-file", str(tmp_path / "missing.secret"))
    try:
        code, log = _exit_and_log(proc, tmp_path)
        assert code == 1 and "--adapter-store-secret-file: store secret file" in log and "cannot read" in log, log
    finally:
        stop(proc)


def test_a_store_that_never_answers_is_waited_for_then_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from server_helpers import free_port

    proc, address = start_server(tiny_llama_dir, tmp_path, "--adapter-store", f"127.0.0.1:{free_port()}",
                                 "--adapter-store-wait-s", "6")
    try:
        seen = set()
        with LoraplexClient(address, retry_attempts=1, timeout=2) as client:
            while proc.poll() is None:
                try:
                    seen.add(client.health())
                except LoraplexClientError:
                    pass  # the port is not open yet
                time.sleep(0.1)
        code, log = _exit_and_log(proc, tmp_path)
        assert code == 1 and seen == {"NOT_SERVING"}, (seen, log)
        assert "did not answer within 6s" in log and "--adapter-store (LORAPLEX_ADAPTER_STORE)" in log, log
        assert log.count("waiting up to 6s for the adapter store") == 1, "one line while waiting, not one a second"
    finally:
        stop(proc)
