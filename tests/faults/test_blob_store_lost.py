"""S3 losing its objects behind the store's back (the bucket recreated empty) is detected and
reported (an error in the log, a metric, a health detail), not served from the Redis index and
cache that still name the lost adapters; uploads work again at once. Real redis-server, moto S3
and sidecar processes."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from store_adapters import peft_files
from store_services import free_port

from loraplex.adapter_store.errors import AdapterNotFoundError

DETAIL = "loraplex.v1.AdapterStore/blob-store"


def _recreate_bucket_empty(rig) -> None:  # noqa: ANN001
    s3 = rig.moto.s3()
    for obj in s3.list_objects_v2(Bucket=rig.bucket).get("Contents", []):
        s3.delete_object(Bucket=rig.bucket, Key=obj["Key"])
    s3.delete_bucket(Bucket=rig.bucket)
    s3.create_bucket(Bucket=rig.bucket)


def _health(target: str, service: str) -> str:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _lost_count(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("loraplex_store_blob_store_lost_total")]
    return float(lines[0].split()[-1]) if lines else 0.0


def _eventually(check, timeout: float = 15.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _assert_reported(rig, car, index: int, metrics_port: int) -> None:  # noqa: ANN001
    def reported() -> None:
        assert "lost its objects" in rig.log(index), "no error in the sidecar's log"
        assert _lost_count(metrics_port) == 1
        assert _health(car.target, DETAIL) == "NOT_SERVING"

    _eventually(reported)
    assert _health(car.target, "") == "SERVING"  # it still serves what there is


def test_bucket_recreated_empty_is_reported_and_not_served_from_the_index(rig, fault_adapters):
    metrics_port = free_port()
    car = rig.sidecar("--metrics-port", str(metrics_port))
    with car.client(timeout_s=10) as client:
        client.put_record("acme/lost", fault_adapters["r16-bf16"])
        client.resolve("acme/lost")  # in the Redis index and cache
        _recreate_bucket_empty(rig)

        _eventually(lambda: _assert_not_listed(client, "acme/lost"))
        with pytest.raises(AdapterNotFoundError):
            client.resolve("acme/lost")
        _assert_reported(rig, car, 0, metrics_port)

        record = client.put_record("acme/new", fault_adapters["r4-fp32"])  # the store recovers at once
        assert client.resolve("acme/new").files == peft_files(fault_adapters["r4-fp32"])
        assert [i.adapter_id for i in client.list()] == ["acme/new"]
        assert rig.head("acme/new").version == record.version


def test_a_sidecar_started_after_the_loss_reports_it(rig, fault_adapters):
    first = rig.sidecar()
    with first.client(timeout_s=10) as client:
        client.put_record("acme/gone", fault_adapters["r4-fp32"])
    first.sigkill()
    _recreate_bucket_empty(rig)  # while no sidecar runs: only Redis remembers

    metrics_port = free_port()
    second = rig.sidecar("--metrics-port", str(metrics_port))
    with second.client(timeout_s=10) as client:
        _eventually(lambda: _assert_not_listed(client, "acme/gone"))
        with pytest.raises(AdapterNotFoundError):
            client.resolve("acme/gone")
    _assert_reported(rig, second, 1, metrics_port)


def _assert_not_listed(client, adapter_id: str) -> None:  # noqa: ANN001
    assert adapter_id not in [i.adapter_id for i in client.list()]
