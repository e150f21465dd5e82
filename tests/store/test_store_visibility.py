"""Public adapters in the store: the flag is stored with the version (and survives restarts and
re-reads), and a call that names its caller is held to the tenant rules by the store itself."""

from __future__ import annotations

import json

import grpc
import pytest

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError, PermissionDeniedError
from loraplex.adapter_store.protocol import ROLE_METADATA_KEY, TENANT_METADATA_KEY
from loraplex.adapter_store.records import StoredRecord
from loraplex.adapter_store.tenants.principal import Principal, Role
from loraplex.v1 import store_pb2 as pb, store_pb2_grpc

pytestmark = pytest.mark.slow  # starts gRPC servers (and Redis / moto)

A, B, ADMIN = Principal("a", Role.TENANT), Principal("b", Role.TENANT), Principal("ops", Role.ADMIN)


def _as(env, caller: Principal) -> StoreClient:
    client = StoreClient(env.server.target, retries=0, timeout_s=20, caller=caller)
    env.extra_clients.append(client)
    return client


def _same_place(settings):
    return dict(local_dir=settings.local_dir, s3=settings.s3, redis=settings.redis)


def test_public_flag_is_stored_with_the_version_and_survives_a_restart(env, make_env, adapters):
    info = env.client.put("a/pub", adapters["r4-fp32"], public=True)
    env.client.put("a/priv", adapters["r4-fp32"])
    assert info.public and env.client.get("a/pub").public and env.client.resolve("a/pub").info.public
    assert {i.adapter_id: i.public for i in env.client.list()} == {"a/priv": False, "a/pub": True}
    env.close()
    again = make_env(env.kind, redis_proc=env.redis, moto_proc=env.moto, **_same_place(env.settings))
    assert again.client.get("a/pub").public and not again.client.get("a/priv").public
    flipped = again.client.put("a/pub", adapters["r4-fp32"])  # same bytes, no public: private again
    assert flipped.version == info.version and not flipped.public
    assert not again.client.get("a/pub").public and not again.client.resolve("a/pub").info.public


def test_the_store_holds_a_named_caller_to_the_tenant_rules(make_env, adapters):
    env = make_env("local-memory")
    env.client.put("a/pub", adapters["r4-fp32"], public=True)  # the server's own calls: no caller
    env.client.put("a/priv", adapters["r16-bf16"])
    env.client.put("b/own", adapters["r4-fp32"])
    env.client.put("shared", adapters["r4-fp32"])
    before = {i.adapter_id: (i.version, i.public) for i in env.client.list()}
    a, b, admin = _as(env, A), _as(env, B), _as(env, ADMIN)

    assert b.get("a/pub").public and b.resolve("a/pub").info.adapter_id == "a/pub"
    assert [i.adapter_id for i in b.list()] == ["a/pub", "b/own", "shared"]
    assert [r.adapter_id for r in b.iter_records(tenant="a", page_size=1)] == ["a/pub"]
    for hidden in ("a/priv", "a/never-existed"):  # the same answer: no existence leak
        for call in (b.get, b.resolve):
            with pytest.raises(AdapterNotFoundError, match=f"'{hidden}' not found"):
                call(hidden)
    for target in ("a/pub", "a/priv", "shared"):
        with pytest.raises(PermissionDeniedError, match=f"tenant 'b' may not upload adapter '{target}'"):
            b.put(target, adapters["r64-fp32"])
        with pytest.raises(PermissionDeniedError, match=f"tenant 'b' may not delete adapter '{target}'"):
            b.delete(target)
    with pytest.raises(PermissionDeniedError, match="may not Watch"):
        next(iter(b.watch()))
    assert b.put("b/new", adapters["r4-fp32"], public=True).public
    b.delete("b/new")
    assert {i.adapter_id: (i.version, i.public) for i in env.client.list()} == before  # a's are untouched

    a.put("a/pub", adapters["r4-fp32"])  # the owner flips it private (re-upload without public)
    with pytest.raises(AdapterNotFoundError, match="'a/pub' not found"):
        b.get("a/pub")
    with pytest.raises(AdapterNotFoundError, match="'a/pub' not found"):
        b.resolve("a/pub")
    assert [i.adapter_id for i in b.list()] == ["b/own", "shared"]
    assert [i.adapter_id for i in a.list()] == ["a/priv", "a/pub", "shared"]
    assert [i.adapter_id for i in admin.list()] == ["a/priv", "a/pub", "b/own", "shared"]
    admin.delete("a/priv")


def test_malformed_caller_metadata_is_invalid_argument_naming_it(make_env):
    env = make_env("local-memory")
    with grpc.insecure_channel(env.server.target) as channel:
        stub = store_pb2_grpc.AdapterStoreStub(channel)
        for metadata, problem in (
            (((TENANT_METADATA_KEY, "b"), (ROLE_METADATA_KEY, "root")), "must be 'tenant' or 'admin', got 'root'"),
            (((ROLE_METADATA_KEY, "admin"),), f"needs {TENANT_METADATA_KEY}"),
            (((TENANT_METADATA_KEY, "b/x"),), f"metadata {TENANT_METADATA_KEY}: tenant 'b/x'"),
            # two tenants in one call used to act as the last of them
            (((TENANT_METADATA_KEY, "a"), (TENANT_METADATA_KEY, "b")), f"{TENANT_METADATA_KEY} given more than once"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.List(pb.StoreListRequest(), metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in info.value.details()


def test_a_record_written_without_the_field_reads_as_private(make_env, adapters):
    env = make_env("local-memory")
    stored = env.client.put("a/old", adapters["r4-fp32"], public=True)
    body = json.loads(env.store.blobs.read_head("a/old"))
    del body["public"]  # as written before the flag existed
    env.store.blobs.write_head("a/old", json.dumps(body).encode())
    env.close()
    again = make_env("local-memory", local_dir=env.settings.local_dir)  # a fresh index reads the head
    record = again.client.stat("a/old")
    assert record.version == stored.version and record.public is False
    with pytest.raises(AdapterNotFoundError, match="'a/old' not found"):
        _as(again, B).get("a/old")
    assert _as(again, A).get("a/old").public is False


def test_record_json_round_trips_the_flag_and_refuses_a_non_boolean():
    body = {"adapter_id": "a/x", "version": "v", "sha256": "0" * 64, "rank": 4, "lora_alpha": 8.0,
            "target_modules": ["q_proj"], "dtype": "F32", "size_bytes": 3, "created_at": 1.0, "files": []}
    assert StoredRecord.from_json(json.dumps(body)).info.public is False
    public = StoredRecord.from_json(json.dumps({**body, "public": True}))
    assert public.info.public is True and StoredRecord.from_json(public.to_json()).info.public is True
    with pytest.raises(TypeError, match="'public' must be true or false, got 'yes'"):
        StoredRecord.from_json(json.dumps({**body, "public": "yes"}))

