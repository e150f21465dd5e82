"""The ``loraplex-store`` process: two of them sharing Redis and S3, and the embedded default."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from store_adapters import peft_files
from store_services import StoreProcess, free_port

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError
from loraplex.adapter_store.records import KIND_DELETE, KIND_PUT, KIND_RESYNC

pytestmark = pytest.mark.slow


class Collector:
    """Follows a Watch in a thread; ``wait_for(kind, version)`` blocks until such an event arrived."""

    def __init__(self, watch) -> None:  # noqa: ANN001
        self.watch = watch
        self.events = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for ev in self.watch:
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()

    def wait_for(self, kind: str, version: str = "", timeout: float = 15.0):  # noqa: ANN201
        def match():
            return next((e for e in self.events if e.kind == kind and (not version or e.version == version)), None)

        with self._cond:
            assert self._cond.wait_for(match, timeout), f"no {kind} {version} event; got {self.events}"
            return match()

    def stop(self) -> None:
        self.watch.cancel()
        self._thread.join(5)


def test_reupload_through_one_store_is_seen_by_watch_on_the_other(tmp_path, shared_redis, shared_moto, adapters):
    bucket = f"shared-{uuid.uuid4().hex[:10]}"
    shared_moto.s3().create_bucket(Bucket=bucket)
    args = ["--s3-bucket", bucket, "--s3-endpoint-url", shared_moto.endpoint, "--s3-region", "us-east-1",
            "--redis-url", shared_redis.url, "--redis-namespace", f"two:{uuid.uuid4().hex[:8]}"]
    a = StoreProcess(args, tmp_path / "a.log")
    b = StoreProcess(args, tmp_path / "b.log")
    try:
        with StoreClient(a.target) as ca, StoreClient(b.target) as cb:
            watch = Collector(cb.watch(tenant="acme"))
            watch.wait_for(KIND_RESYNC)
            v1 = ca.put("acme/shared", adapters["r4-fp32"]).version
            assert watch.wait_for(KIND_PUT, v1).adapter_id == "acme/shared"
            assert cb.resolve("acme/shared").info.version == v1

            v2 = ca.put("acme/shared", adapters["r16-bf16"]).version
            assert v2 != v1
            watch.wait_for(KIND_PUT, v2)
            got = cb.resolve("acme/shared")
            assert got.info.version == v2 and got.files == peft_files(adapters["r16-bf16"])

            ca.delete("acme/shared")
            watch.wait_for(KIND_DELETE, v2)
            with pytest.raises(AdapterNotFoundError):
                cb.get("acme/shared")
            watch.stop()
    finally:
        assert a.stop() == 0, (tmp_path / "a.log").read_text()[-2000:]
        assert b.stop() == 0, (tmp_path / "b.log").read_text()[-2000:]


def test_default_store_process_needs_nothing_external(tmp_path, adapters):
    metrics_port = free_port()
    args = ["--local-dir", str(tmp_path / "adapters"), "--metrics-port", str(metrics_port)]
    proc = StoreProcess(args, tmp_path / "store.log")
    try:
        channel = grpc.insecure_channel(proc.target)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        services = _reflected_services(channel)
        assert "loraplex.v1.AdapterStore" in services and "grpc.health.v1.Health" in services
        with StoreClient(proc.target) as client:
            version = client.put("tenant/local", adapters["r32-bf16"]).version
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'loraplex_store_uploads_total{outcome="stored"} 1.0' in body
        channel.close()
    finally:
        assert proc.stop() == 0
    again = StoreProcess(["--local-dir", str(tmp_path / "adapters")], tmp_path / "store2.log")
    try:
        with StoreClient(again.target) as client:
            assert client.get("tenant/local").version == version
            assert client.resolve("tenant/local").files == peft_files(adapters["r32-bf16"])
    finally:
        again.stop()


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return {s.name for r in responses for s in r.list_services_response.service}


def test_bad_settings_exit_with_a_clear_message():
    out = subprocess.run(
        [sys.executable, "-P", "-m", "loraplex.adapter_store.main", "--s3-bucket", "b", "--s3-prefix", "no-slash"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "prefix must end with '/'" in out.stderr


def test_a_port_in_use_stops_the_store_naming_it(tmp_path):
    """A second store on the port of a running one shared it (gRPC's SO_REUSEPORT): it said it was
    listening, and calls went to one store or the other, each with its own adapters."""
    first = StoreProcess(["--local-dir", str(tmp_path / "a")], tmp_path / "store.log")
    try:
        out = _store_at_start(["--listen", first.target, "--local-dir", str(tmp_path / "b")], dict(os.environ))
    finally:
        first.stop()
    assert out.returncode == 1 and f"loraplex-store: cannot listen on {first.target}" in out.stderr, out.stderr


def _store_at_start(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``loraplex-store`` started with ``args`` in ``env`` until it exits (or 60 s pass)."""
    return subprocess.run([sys.executable, "-P", "-m", "loraplex.adapter_store.main", "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_missing_s3_credentials_stop_the_store_like_a_missing_bucket(shared_moto, tmp_path):
    """One rule at start: an S3 answer that says a setting is wrong (no such bucket, no credentials)
    stops the store with exit code 1 and the fix; it used to log "unreachable: Unable to locate
    credentials; serving" and start, so every call then failed."""
    import os

    bucket = f"creds-{uuid.uuid4().hex[:10]}"
    shared_moto.s3().create_bucket(Bucket=bucket)
    s3 = ["--s3-bucket", bucket, "--s3-endpoint-url", shared_moto.endpoint, "--s3-region", "us-east-1"]
    no_credentials = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    no_credentials.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                          AWS_EC2_METADATA_DISABLED="true")
    out = _store_at_start(s3, no_credentials)
    assert out.returncode == 1, out.stderr
    assert "cannot start" in out.stderr and "Unable to locate credentials" in out.stderr, out.stderr
    assert "AWS_ACCESS_KEY_ID" in out.stderr and "--s3-profile" in out.stderr, out.stderr
    missing_bucket = _store_at_start([*s3[:1], "no-such-bucket", *s3[2:]], dict(os.environ))
    assert missing_bucket.returncode == 1 and "does not exist" in missing_bucket.stderr, missing_bucket.stderr
    assert "create the bucket first" in missing_bucket.stderr
    unknown_profile = _store_at_start([*s3, "--s3-profile", "nobody"], no_credentials)
    assert unknown_profile.returncode == 2 and "--s3-profile 'nobody'" in unknown_profile.stderr, unknown_profile.stderr
