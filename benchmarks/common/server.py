"""The one way the benchmarks start a server: a real process on loopback, started, waited for until it
serves, stopped.

bench_open_loop, bench_grpc_vs_inprocess and bench_http_vs_grpc all reach the server the way a
deployment does: a separate process, its gRPC port and (where asked) its OpenAI-compatible HTTP
port. ``start_server`` runs ``loraplex-server`` (``SERVER``) or another program that takes the same
port flags (the synthetic engine's server, ``SYNTHETIC_SERVER``; the server with a GIL switch
interval, ``server_with_switch_interval``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT as REPO


def free_port() -> int:
    """A TCP port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, proc: subprocess.Popen | None = None, log: Path | None = None,
                 timeout: float = 600.0) -> str:
    """Poll gRPC health at ``address`` until SERVING; RuntimeError with the log's tail if ``proc``
    exits first, TimeoutError after ``timeout`` seconds. Returns ``address``."""
    from loraplex.clients import LoraplexClient

    deadline = time.monotonic() + timeout
    with LoraplexClient(address, timeout=5) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
                raise RuntimeError(f"the server exited with {proc.returncode} before serving:\n{tail}")
            try:
                if client.health(timeout=2) == "SERVING":
                    return address
            except Exception:  # noqa: BLE001  (not listening yet)
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s")
            time.sleep(0.2)


def wait_http(port: int, timeout: float = 60.0) -> None:
    """Wait for the HTTP edge's /health to answer 200 (never /v1/models: listing thousands of
    stored adapters reads and hashes every one of them)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (OSError, urllib.error.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def base_model_id(address: str) -> str:
    """The base model's id on both edges: ServerInfo's model name (as /v1/models lists it first)."""
    from loraplex.clients import LoraplexClient

    with LoraplexClient(address, timeout=10) as client:
        return client.server_info().model_name


PREFIX_COUNTERS = ("loraplex_prefix_cache_queried_tokens_total", "loraplex_prefix_cache_hit_tokens_total")


def prefix_cache_tokens(http_port: int) -> tuple[float, float]:
    """(prompt tokens looked up in the prefix cache, tokens served from it) so far, from the HTTP
    edge's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        values = dict(line.split(" ", 1) for line in r.read().decode().splitlines()
                      if line.startswith(PREFIX_COUNTERS))
    return float(values.get(PREFIX_COUNTERS[0], 0)), float(values.get(PREFIX_COUNTERS[1], 0))


@dataclass(frozen=True, slots=True)
class Server:
    """A started server process and how to reach it."""

    proc: subprocess.Popen
    grpc_address: str
    http_port: int  # 0: the HTTP edge is off
    base_model: str  # the base model's id (the HTTP edge's ``model`` for no adapter)
    log: Path

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


SERVER = ("-P", "-m", "loraplex.inference_server.main")
# the model-free engine behind the real server: a module of this package, so the checkout root is on
# sys.path (the package puts it last) instead of -P
SYNTHETIC_SERVER = ("-m", "benchmarks.serving.synthetic_engine")


def server_with_switch_interval(seconds: float) -> tuple[str, ...]:
    """loraplex-server with ``sys.setswitchinterval(seconds)`` (the GIL hand-off interval) set first."""
    return ("-P", "-c", f"import sys; sys.setswitchinterval({seconds}); "
                        "from loraplex.inference_server.main import main; sys.exit(main())")


def start_server(flags: list[str], log: Path, http: bool = True, timeout: float = 600.0,
                 program: tuple[str, ...] = SERVER) -> Server:
    """``python <program> <flags>`` on free gRPC (and HTTP) ports, metrics off, output to ``log``;
    returns once it serves (RuntimeError with the log's tail if it exits first). ``flags`` name the
    model, device, adapters; ``program`` is ``SERVER`` unless another server is meant."""
    port, http_port = free_port(), free_port() if http else 0
    cmd = [sys.executable, *program, *flags, "--port", str(port), "--http-port", str(http_port),
           "--metrics-port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        address = wait_serving(f"127.0.0.1:{port}", proc, log, timeout)
        if http:
            wait_http(http_port)
        base = base_model_id(address)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return Server(proc, address, http_port, base, log)
