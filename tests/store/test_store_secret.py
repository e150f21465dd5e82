"""The store sidecar trusts only the inference server: calls without its shared secret are refused."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from store_services import ServerThread

from loraplex.adapter_store.auth import is_loopback
from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import LoraplexError
from loraplex.adapter_store.factory import build_store
from loraplex.adapter_store.main import parse_args
from loraplex.adapter_store.protocol import SECRET_METADATA_KEY
from loraplex.adapter_store.secret import read_secret
from loraplex.adapter_store.settings import StoreSettings
from loraplex.v1 import store_pb2, store_pb2_grpc

SECRET = "store-secret-0123456789"


@pytest.mark.slow  # starts a gRPC server
def test_calls_without_the_secret_are_refused_and_leave_adapters_untouched(tmp_path, adapters, caplog):
    store = build_store(StoreSettings(local_dir=str(tmp_path)))
    server = ServerThread(store, secret=SECRET)
    try:
        with StoreClient(server.target, secret=SECRET) as trusted:
            trusted.put("b/private", adapters["r16-bf16"])
        caplog.set_level(logging.WARNING, logger="loraplex.adapter_store.auth")
        for secret in (None, "wrong-secret-0123456789"):
            with StoreClient(server.target, secret=secret, retries=0) as intruder:
                calls = (lambda: intruder.list(), lambda: intruder.get("b/private"),
                         lambda: intruder.fetch("b/private"), lambda: intruder.delete("b/private"),
                         lambda: intruder.put("b/private", adapters["r4-fp32"]),
                         lambda: next(iter(intruder.watch())))
                for call in calls:
                    with pytest.raises(LoraplexError, match="UNAUTHENTICATED"):
                        call()
        with grpc.insecure_channel(server.target) as channel:  # a wrong secret beside the right one: refused
            stub = store_pb2_grpc.AdapterStoreStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.List(store_pb2.StoreListRequest(), timeout=10, metadata=(
                    (SECRET_METADATA_KEY, "wrong-secret-0123456789"), (SECRET_METADATA_KEY, SECRET)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with StoreClient(server.target, secret=SECRET) as trusted:
            assert [i.adapter_id for i in trusted.list()] == ["b/private"]
            assert trusted.get("b/private").rank == 16  # not overwritten by the r4 attempt
        with grpc.insecure_channel(server.target) as channel:  # probes need no secret
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refusals = [r.getMessage() for r in caplog.records if "store call refused" in r.getMessage()]
        assert len(refusals) >= 12 and all(SECRET not in m and "wrong-secret" not in m for m in refusals)
    finally:
        server.stop()


def test_secret_file_and_listen_address_checks(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert read_secret(str(path)) == SECRET
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(str(tmp_path / "missing"))
    settings, _ = parse_args(["--secret-file", str(path)], env={})
    assert settings.secret_file == str(path) and settings.listen == "127.0.0.1:50061"
    assert is_loopback("127.0.0.1:1") and is_loopback("[::1]:1") and is_loopback("localhost:1")
    assert not is_loopback("0.0.0.0:50061") and not is_loopback("10.0.0.1:1")
