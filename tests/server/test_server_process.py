"""``loraplex-server`` as a real process: health goes NOT_SERVING -> SERVING while the model
loads, and SIGTERM during streams stops admitting but lets the open streams finish."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import LoraplexClientError, UnavailableError
from server_process import REPO, start_server, stop

pytestmark = pytest.mark.slow


def test_health_then_sigterm_drains_open_streams(tiny_llama_dir: Path, tmp_path: Path) -> None:
    proc, address = start_server(tiny_llama_dir, tmp_path, "--grace-period-s", "60")
    try:
        statuses = []
        with LoraplexClient(address, retry_attempts=1, timeout=2) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and statuses[-1:] != ["SERVING"]:
                try:
                    status = client.health()
                    if statuses[-1:] != [status]:
                        statuses.append(status)
                except LoraplexClientError:
                    pass  # the port is not open yet
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                time.sleep(0.02)
            assert statuses == ["NOT_SERVING", "SERVING"]

            results: dict[int, list] = {}
            started = threading.Barrier(5)

            def stream(i: int) -> None:
                events = []
                for event in client.generate(f"story {i}", max_new_tokens=300, ignore_eos=True, timeout=120):
                    if not events:
                        started.wait(30)
                    events.append(event)
                results[i] = events

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            started.wait(30)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            with pytest.raises(UnavailableError):
                client.generate_text("too late")
            for t in threads:
                t.join(120)
        assert proc.wait(60) == 0
        assert sorted(results) == [0, 1, 2, 3]
        for events in results.values():
            assert events[-1].finish_reason == "length"
            assert sum(len(e.token_ids) for e in events) == 300
        log = (tmp_path / "server.log").read_text()
        assert "draining 4 open stream(s)" in log and "gRPC server stopped" in log
    finally:
        stop(proc)


def test_bad_settings_exit_2_with_a_clear_message(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-P", "-m", "loraplex.inference_server.main", "--port", "70000"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "port" in result.stderr and "65535" in result.stderr and "LORAPLEX_PORT" in result.stderr


def test_unloadable_model_exits_1(tmp_path: Path) -> None:
    proc, _ = start_server(tmp_path / "missing-model", tmp_path)
    try:
        assert proc.wait(300) == 1  # generous: CI machines can be slow to import torch
        assert "cannot load the model" in (tmp_path / "server.log").read_text()
    finally:
        stop(proc)


def test_sigterm_while_the_model_loads_exits_cleanly_with_json_logs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json

    proc, address = start_server(tiny_llama_dir, tmp_path, "--log-format", "json")
    try:
        with LoraplexClient(address, retry_attempts=1, timeout=2) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    status = client.health()
                    break
                except LoraplexClientError:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.01)
        assert status == "NOT_SERVING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        records = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()
                   if line.startswith("{")]
        messages = [r["message"] for r in records]
        assert "stop requested while the model was loading" in messages
        assert {"time", "level", "logger", "message"} <= set(records[0])
    finally:
        stop(proc)


def test_json_logs_hold_only_json_lines_from_start_to_exit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A log shipper reads one JSON object a line: the weights' progress bar (drawn on a terminal
    only) must not mix its carriage-return updates into a log file."""
    import json

    proc, address = start_server(tiny_llama_dir, tmp_path, "--log-format", "json")
    try:
        with LoraplexClient(address, retry_attempts=1, timeout=2) as client:
            client.wait_until_serving(240)
            assert client.generate_text("Hi", max_new_tokens=2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        lines = [line for line in (tmp_path / "server.log").read_text().split("\n") if line.strip()]
        records = [json.loads(line) for line in lines]  # each one an object, nothing else
        assert any("serving" in r["message"].lower() for r in records), [r["message"] for r in records]
    finally:
        stop(proc)


@pytest.mark.parametrize("flag", ["--metrics-port", "--health-port", "--http-port"])
def test_a_taken_port_stops_the_server_naming_its_flag(tiny_llama_dir: Path, tmp_path: Path, flag: str) -> None:
    """Each port the server opens besides the gRPC one (a second instance that forgot to move it):
    exit 1 with one line naming the flag and the address, no traceback, nothing left running."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    proc, _ = start_server(tiny_llama_dir, tmp_path, flag, str(port))
    try:
        assert proc.wait(120) == 1
        log = (tmp_path / "server.log").read_text()
        assert f"{flag}: cannot listen on 127.0.0.1:{port}" in log, log
        assert "Traceback" not in log and "Exception ignored" not in log and "never awaited" not in log, log
    finally:
        stop(proc)
        taken.close()


def test_a_second_sigterm_ends_the_drain_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An operator who signals twice (Ctrl-C twice, `kill` again) does not wait out a long grace
    period: the open streams end with finish reason "abort" and the process exits 0."""
    proc, address = start_server(tiny_llama_dir, tmp_path, "--grace-period-s", "300")
    try:
        with LoraplexClient(address, retry_attempts=1, timeout=5) as client:
            client.wait_until_serving(120)
            events = []
            started = threading.Event()

            def stream() -> None:
                for event in client.generate("story", max_new_tokens=1900, ignore_eos=True, timeout=300):
                    events.append(event)
                    started.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert started.wait(60)
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert proc.poll() is None and reader.is_alive()  # the first signal drains: the stream goes on
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            reader.join(60)
            assert not reader.is_alive()
        assert proc.wait(60) == 0
        assert time.monotonic() - signalled < 30  # not the 300 s grace period
        assert events[-1].finish_reason == "abort"
        assert "stop requested again: aborting 1 stream(s)" in (tmp_path / "server.log").read_text()
    finally:
        stop(proc)
