"""Real services for the store tests: redis-server and moto's S3 server on free loopback
ports, plus the store's gRPC server in a background thread and as a separate process."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from loraplex.adapter_store.server import StoreServer
from loraplex.adapter_store.store import Store

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def aws_test_credentials() -> Iterator[None]:
    """moto accepts any credentials; boto3 needs some to sign requests (conftests make it autouse)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout}s")


class RedisProcess:
    """redis-server on 127.0.0.1 without persistence: kill() loses everything, like a crash."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc, "redis-server")
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while not _pings(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False


class MotoProcess:
    """moto's S3 in server mode (a real HTTP endpoint) on 127.0.0.1."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **AWS_ENV},
        )
        _wait_port(self.port, self.proc, "moto_server")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def s3(self):  # noqa: ANN201  (a boto3 S3 client)
        import boto3  # noqa: PLC0415

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class ServerThread:
    """A StoreServer on its own event loop in a background thread (blocking clients can call it)."""

    def __init__(self, store: Store, maintain_interval_s: float = 0.2, secret: str | None = None,
                 listen: str = "127.0.0.1:0") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="store-server", daemon=True)
        self._thread.start()
        self.server = StoreServer(store, listen, chunk_bytes=64 * 1024, maintain_interval_s=maintain_interval_s,
                                  secret=secret)
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class StoreProcess:
    """``python -m loraplex.adapter_store.main`` as a child process; ``target`` once it listens."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "loraplex.adapter_store.main", "--listen", "127.0.0.1:0", *args],
                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                env={**os.environ, **AWS_ENV, **(env or {})},
            )
        line = self.proc.stdout.readline()
        if "listening on port" not in line:
            self.proc.kill()
            raise RuntimeError(f"store process did not start: {line!r}\n{log_path.read_text()[-2000:]}")
        self.target = f"127.0.0.1:{int(line.rsplit(' ', 1)[1])}"

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
