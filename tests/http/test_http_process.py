"""``loraplex-server`` as a real process with its HTTP port: /health goes 503 -> 200 as the
model loads, and SIGTERM during HTTP streams refuses new requests (503) but lets the open
streams finish with their last chunk and [DONE], then exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_helpers import free_port
from server_process import start_server, stop

pytestmark = pytest.mark.slow


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


def _stream(port: int, model: str, prompt: str, out: list, started: threading.Barrier) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": model, "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data: ") and not out:
            started.wait(30)
        if line.strip():
            out.append(line.strip())
    conn.close()


def test_sigterm_drains_http_streams(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    proc, _ = start_server(tiny_llama_dir, tmp_path, "--grace-period-s", "60", "--http-port", str(port))
    try:
        statuses: list[int | None] = []
        deadline = time.monotonic() + 120
        while statuses[-1:] != [200] and time.monotonic() < deadline:
            status = _health(port)
            if status is not None and statuses[-1:] != [status]:
                statuses.append(status)
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.02)
        assert statuses in ([503, 200], [200])  # 503 while loading, unless the load won the race
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read())
        base = models["data"][0]["id"]
        results = [[] for _ in range(3)]
        started = threading.Barrier(4)
        threads = [threading.Thread(target=_stream, args=(port, base, f"story {i}", results[i], started))
                   for i in range(3)]
        for t in threads:
            t.start()
        started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert _health(port) == 503
        late = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                      data=json.dumps({"model": base, "prompt": "late"}).encode(),
                                      headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(late, timeout=5)
        assert refused.value.code == 503
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
        for lines in results:
            assert lines[-1] == b"data: [DONE]"
            last = json.loads(lines[-2].removeprefix(b"data: "))
            assert last["choices"][0]["finish_reason"] == "length"
    finally:
        stop(proc)
