"""Tenants over gRPC: two tenants and an admin against the real edge (fake engine).

Every cross-tenant attempt is refused with the specified code and leaves the other's
adapters untouched; a tenant's public adapter is usable by the others and writable by its
owner only, and making it private again hides it at once (adapters in a local directory and
in the store sidecar); bad tokens of every shape are UNAUTHENTICATED; the tokens file is
reloaded without a restart; each quota answers RESOURCE_EXHAUSTED naming its limit; audit
lines name tenant, adapter and outcome and never a token.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from server_helpers import (FAKE_BASE, FakeEngine, ServerThread, StoreThread, upload_refusal_while_holding,
                            write_fake_adapter)

from loraplex.adapter_store.client import StoreClient
from loraplex.clients import (InvalidArgumentError, LoraplexClient, NotFoundError, PermissionDeniedError,
                              ResourceExhaustedError, UnauthenticatedError)
from loraplex.clients.requests import generate_request
from loraplex.inference_server.auth.quotas import TenantLimits
from loraplex.inference_server.auth.security import Security
from loraplex.inference_server.auth.tokens import TokenFile, hash_token
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from tenant_tokens import TOKENS, write_tokens

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture
def tenants(tmp_path: Path):
    """(server, tokens file path, adapter folder, engine) with a/private, b/private and shared uploaded by admin."""
    tokens_path = tmp_path / "tokens.json"
    write_tokens(tokens_path, TOKENS)
    security = Security(tokens=TokenFile(str(tokens_path), check_interval_s=0.0))
    srv = ServerThread(ServerOptions(port=0), security=security)
    engine = FakeEngine(tmp_path / "adapters")
    srv.attach(engine)
    folder = write_fake_adapter(tmp_path / "peft")
    with client(srv, "admin") as admin:
        for adapter_id in ("a/private", "b/private", "shared"):
            admin.upload_adapter(adapter_id, folder)
    yield srv, tokens_path, folder, engine
    srv.close()


def client(srv: ServerThread, who: str | None, **kw) -> LoraplexClient:
    return LoraplexClient(srv.address, timeout=10, retry_attempts=1, token=TOKENS.get(who), **kw)


@pytest.fixture(params=["local-dir", "store-sidecar"])
def public_tenants(request, tmp_path: Path):
    """(server, PEFT folder, another PEFT folder): tenants a and b and an admin; adapters in a local
    directory, or in the store sidecar (its gRPC service, reached by a StoreClient)."""
    tokens_path = tmp_path / "tokens.json"
    write_tokens(tokens_path, TOKENS)
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tokens_path))))
    engine = FakeEngine(tmp_path / "adapters")
    store = StoreThread(tmp_path / "store") if request.param == "store-sidecar" else None
    if store is not None:
        engine.use_store(StoreClient(store.target, base=FAKE_BASE, retries=0, timeout_s=10))
    srv.attach(engine)
    srv.engine = engine  # (the test reads the requests the engine was given)
    yield srv, write_fake_adapter(tmp_path / "peft"), write_fake_adapter(tmp_path / "peft8", rank=8)
    srv.close()
    if store is not None:
        engine.adapters.source.close()
        store.close()


def test_public_adapter_is_used_by_other_tenants_and_written_by_its_owner_only(public_tenants, caplog) -> None:
    srv, folder, other_folder = public_tenants
    caplog.set_level(logging.INFO)
    with client(srv, "a") as a, client(srv, "b") as b, client(srv, "admin") as admin:
        uploaded = a.upload_adapter("a/pub", folder, public=True)
        a.upload_adapter("a/private", folder)
        admin.upload_adapter("shared", folder)
        assert uploaded.public and a.get_adapter("a/pub").public

        assert b.generate_text("hi", adapter="a/pub", max_new_tokens=3).usage.completion_tokens == 3
        # admitted for the public version it read: the engine runs that one or none
        assert srv.engine.requests[-1].adapter_version == uploaded.version
        assert b.get_adapter("a/pub").public
        assert [(i.adapter_id, i.public) for i in b.list_adapters()] == [("a/pub", True), ("shared", False)]
        assert [i.adapter_id for i in b.list_adapters(prefix="a/")] == ["a/pub"]
        for call in (lambda: b.delete_adapter("a/pub"), lambda: b.upload_adapter("a/pub", other_folder),
                     lambda: b.upload_adapter("a/pub", other_folder, public=True)):
            with pytest.raises(PermissionDeniedError, match="tenant 'b' may not (delete|upload) adapter 'a/pub'"):
                call()
        after = admin.get_adapter("a/pub")  # untouched: same version (rank 4, not 8), still public
        assert (after.version, after.rank, after.public) == (uploaded.version, 4, True)

        flipped = a.upload_adapter("a/pub", folder)  # the owner re-uploads without public: private
        assert flipped.version == uploaded.version and not flipped.public
        for call in (lambda: b.generate_text("hi", adapter="a/pub", max_new_tokens=2),
                     lambda: b.get_adapter("a/pub")):
            with pytest.raises(NotFoundError, match="adapter 'a/pub' not found"):  # at once, as if it never was
                call()
        assert [i.adapter_id for i in b.list_adapters()] == ["shared"]
        with pytest.raises(PermissionDeniedError, match="may not delete"):
            b.delete_adapter("a/pub")  # the same answer as for any id outside b's namespace
        assert a.generate_text("hi", adapter="a/pub", max_new_tokens=2).usage.completion_tokens == 2
        assert srv.engine.requests[-1].adapter_version is None  # the owner's own: whatever is current
        assert [(i.adapter_id, i.public) for i in a.list_adapters()] == [
            ("a/private", False), ("a/pub", False), ("shared", False)]

        a.upload_adapter("a/pub", folder, public=True)  # and public again takes effect at once too
        assert b.generate_text("hi", adapter="a/pub", max_new_tokens=1).usage.completion_tokens == 1
    audit = [r.getMessage() for r in caplog.records if r.name == "loraplex.audit"]
    assert any("audit: upload tenant=a role=tenant adapter=a/pub outcome=ok" in m and m.endswith("visibility=public")
               for m in audit)
    assert any("audit: upload tenant=b role=tenant adapter=a/pub outcome=PermissionDeniedError" in m for m in audit)
    # the visibility in the CLI's words (AdapterInfo.visibility): an id outside every namespace is shared
    assert any("adapter=shared outcome=ok" in m and m.endswith("visibility=shared") for m in audit)
    assert any("adapter=a/private outcome=ok" in m and m.endswith("visibility=private") for m in audit)


def test_cross_tenant_attempts_are_refused_and_change_nothing(tenants, caplog) -> None:
    srv, _, folder, _ = tenants
    caplog.set_level(logging.INFO)
    with client(srv, "admin") as admin:
        before = {i.adapter_id: i.version for i in admin.list_adapters()}
    with client(srv, "a") as a:
        assert [i.adapter_id for i in a.list_adapters()] == ["a/private", "shared"]
        assert [i.adapter_id for i in a.list_adapters(prefix="b/")] == []
        for missing in ("b/private", "b/never-existed"):  # the same answer: no existence leak
            with pytest.raises(NotFoundError, match=f"adapter '{missing}' not found"):
                a.get_adapter(missing)
            with pytest.raises(NotFoundError, match=f"adapter '{missing}' not found"):
                a.generate_text("hi", adapter=missing, max_new_tokens=2)
        for target in ("b/private", "b/never-existed", "shared"):
            with pytest.raises(PermissionDeniedError, match="may not delete"):
                a.delete_adapter(target)
            with pytest.raises(PermissionDeniedError, match="may not upload"):
                a.upload_adapter(target, folder)
        assert a.generate_text("hi", adapter="shared", max_new_tokens=3).usage.completion_tokens == 3
        assert a.generate_text("hi", adapter="a/private", max_new_tokens=3).usage.completion_tokens == 3
        a.upload_adapter("a/second", folder)
        a.delete_adapter("a/second")
    with client(srv, "admin") as admin:
        assert {i.adapter_id: i.version for i in admin.list_adapters()} == before
        assert admin.get_adapter("b/private").adapter_id == "b/private"
        admin.generate_text("hi", adapter="b/private", max_new_tokens=2)
        admin.delete_adapter("b/private")
        admin.upload_adapter("b/private", folder)
    scrape = generate_latest(srv.server.metrics.registry).decode()
    assert 'loraplex_tenant_generate_requests_total{tenant="a"} 2.0' in scrape
    assert 'loraplex_tenant_adapter_writes_total{action="delete",outcome="refused",tenant="a"} 3.0' in scrape
    # the metrics endpoint has no authentication: no private adapter id there, and no series for
    # ids that do not exist (a tenant could grow it without bound)
    assert 'loraplex_generate_requests_total{adapter="a/*"} 1.0' in scrape
    assert 'loraplex_generate_requests_total{adapter="b/*"} 1.0' in scrape  # the admin's b/private
    assert 'loraplex_generate_requests_total{adapter="shared"} 1.0' in scrape
    assert "a/private" not in scrape and "b/private" not in scrape and "never-existed" not in scrape
    audit = [r.getMessage() for r in caplog.records if r.name == "loraplex.audit"]
    assert any("audit: delete tenant=a role=tenant adapter=b/private outcome=PermissionDeniedError" in m
               for m in audit)
    assert any("audit: upload tenant=a role=tenant adapter=a/second outcome=ok" in m for m in audit)
    assert any("audit: delete tenant=ops role=admin adapter=b/private outcome=ok" in m for m in audit)
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert not any(tok in everything or hash_token(tok) in everything for tok in TOKENS.values())


@pytest.mark.parametrize("value", [
    None, "", "Bearer", "Bearer ", f"Basic {TOKENS['a']}", TOKENS["a"], f"Bearer {TOKENS['a']} ",
    f"Bearer  {TOKENS['a']}", f"Bearer {TOKENS['a']}x", "Bearer " + "y" * 6000, f"Bearer {hash_token(TOKENS['a'])}",
])
def test_bad_credentials_are_unauthenticated_and_audited(tenants, caplog, value) -> None:
    srv = tenants[0]
    caplog.set_level(logging.INFO)
    metadata = None if value is None else (("authorization", value),)
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        for call in (lambda: stub.ListAdapters(pb.ListAdaptersRequest(), metadata=metadata, timeout=5),
                     lambda: next(iter(stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata, timeout=5))),
                     lambda: stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="a/private"),
                                                metadata=metadata, timeout=5)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKENS["a"] not in info.value.details()
    failures = [r.getMessage() for r in caplog.records if "auth_failure" in r.getMessage()]
    assert len(failures) == 3 and all(TOKENS["a"] not in m and "yyyy" not in m for m in failures)
    with client(tenants[0], "admin") as admin:
        assert admin.get_adapter("a/private").adapter_id == "a/private"  # the delete did not happen
        assert admin.health() == "SERVING"


def test_a_token_the_server_would_refuse_is_refused_by_the_client_before_sending(tenants) -> None:
    """Non-ASCII, surrounding whitespace, too short: the server's own rule, named on the client."""
    for bad in ("tökén-0123456789abcdef", f"{TOKENS['a']} ", "short"):
        with pytest.raises(ValueError, match="16-512 printable ASCII characters without spaces"):
            LoraplexClient(tenants[0].address, token=bad)


def test_tokens_file_reload_without_restart(tenants) -> None:
    srv, tokens_path, _, _ = tenants
    rotated = {**TOKENS, "a": "token-tenant-a-rotated-0123"}
    write_tokens(tokens_path, rotated)
    os.utime(tokens_path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    with LoraplexClient(srv.address, timeout=10, retry_attempts=1, token=rotated["a"]) as a:
        assert [i.adapter_id for i in a.list_adapters()] == ["a/private", "shared"]
    with client(srv, "a") as old, pytest.raises(UnauthenticatedError):
        old.list_adapters()


def test_health_needs_no_token(tenants) -> None:
    with client(tenants[0], None) as anonymous:
        assert anonymous.health() == "SERVING"
        with pytest.raises(UnauthenticatedError, match="missing credentials"):
            anonymous.server_info()


def _quota_server(tmp_path: Path, limits: TenantLimits, step_s: float = 0.005):
    tokens_path = tmp_path / "tokens.json"
    write_tokens(tokens_path, TOKENS)
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tokens_path)), limits=limits))
    engine = FakeEngine(tmp_path / "adapters", step_s=step_s)
    srv.attach(engine)
    return srv, engine


def test_request_quotas_answer_resource_exhausted_naming_the_limit(tmp_path) -> None:
    srv, _ = _quota_server(tmp_path, TenantLimits(max_concurrent_requests=2, max_queued_requests=1,
                                                  tokens_per_minute=60), step_s=0.3)
    metadata = (("authorization", f"Bearer {TOKENS['a']}"),)
    try:
        with client(srv, "a") as a, client(srv, "b") as b, grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            held = [stub.Generate(generate_request("hi", max_new_tokens=4), metadata=metadata, timeout=10)]
            time.sleep(0.1)  # open, and waiting for its first token (one token per 0.3 s)
            with pytest.raises(ResourceExhaustedError, match="quota max_queued_requests reached"):
                a.generate_text("hi", max_new_tokens=1)
            next(held[0])  # its first token: no longer queued, still open
            held.append(stub.Generate(generate_request("hi", max_new_tokens=4), metadata=metadata, timeout=10))
            next(held[1])
            with pytest.raises(ResourceExhaustedError, match="quota max_concurrent_requests reached"):
                a.generate_text("hi", max_new_tokens=1)
            assert b.generate_text("hi", max_new_tokens=1).usage.completion_tokens == 1  # B is unaffected
            for call in held:
                list(call)
            # a used 2 x (2 prompt + 4 generated) = 12 tokens this minute; 50 more go over 60
            with pytest.raises(ResourceExhaustedError, match="quota tokens_per_minute reached"):
                a.generate_text("x" * 50, max_new_tokens=1)
            assert a.generate_text("x" * 10, max_new_tokens=1).usage.completion_tokens == 1
    finally:
        srv.close()


def test_a_call_its_quotas_could_never_admit_whole_is_invalid_not_retry_later(tmp_path) -> None:
    """n (or best_of, or a batch of prompts) past the tenant's concurrent or queued requests, or
    their token budget past its tokens per minute, could wait forever: INVALID_ARGUMENT / 400
    naming the parameter, before any choice runs; a call that fits is served."""
    import openai

    srv, engine = _quota_server(tmp_path, TenantLimits(max_concurrent_requests=3, tokens_per_minute=60))
    url = srv.start_http()
    try:
        with client(srv, "a") as a:
            with pytest.raises(InvalidArgumentError, match="n: 4 generations in one call, more than tenant 'a'"):
                a.generate_choices("hi", n=4, max_new_tokens=1)
            with pytest.raises(InvalidArgumentError, match="n: the call may use 82 tokens"):
                a.generate_choices("hi", n=2, max_new_tokens=40)
            with pytest.raises(InvalidArgumentError, match="max_new_tokens: the call may use 72 tokens"):
                a.generate_text("hi", max_new_tokens=70)
            assert engine.requests == []
            assert len(a.generate_choices("hi", n=3, max_new_tokens=2)) == 3
        http = openai.OpenAI(base_url=url, api_key=TOKENS["a"], max_retries=0, timeout=10)
        for kwargs, param in (({"n": 4}, "n"), ({"n": 1, "best_of": 4}, "best_of"), ({"n": 2, "max_tokens": 40}, "n")):
            with pytest.raises(openai.BadRequestError) as caught:
                http.completions.create(model="fake-llama", prompt="hi", **{"max_tokens": 1, **kwargs})
            assert caught.value.body["param"] == param
    finally:
        srv.close()


def test_adapter_quotas_answer_resource_exhausted_naming_the_limit(tmp_path) -> None:
    folder = write_fake_adapter(tmp_path / "peft")
    size = sum(f.stat().st_size for f in folder.iterdir())
    srv, _ = _quota_server(tmp_path, TenantLimits(max_adapters=2, max_adapter_bytes=int(size * 2.5)))
    try:
        with client(srv, "a") as a, client(srv, "admin") as admin:
            a.upload_adapter("a/one", folder)
            a.upload_adapter("a/two", folder)
            a.upload_adapter("a/two", folder)  # a re-upload replaces: still two
            with pytest.raises(ResourceExhaustedError, match="max_adapters"):
                a.upload_adapter("a/three", folder)
            with pytest.raises(ResourceExhaustedError, match="max_adapters"):
                admin.upload_adapter("a/three", folder)  # the quota is the namespace's, whoever uploads
            big = write_fake_adapter(tmp_path / "big", rank=8)
            with pytest.raises(ResourceExhaustedError, match="max_adapter_bytes"):
                a.upload_adapter("a/two", big)
            assert [i.adapter_id for i in a.list_adapters()] == ["a/one", "a/two"]
    finally:
        srv.close()


def test_an_upload_over_the_quota_is_refused_before_its_bytes_are_sent(tmp_path) -> None:
    """The declared sizes are checked against the tenant's quota at the metadata: a client still
    holding every byte after its first chunk hears RESOURCE_EXHAUSTED."""
    srv, _ = _quota_server(tmp_path, TenantLimits(max_adapter_bytes=1 << 20))
    declared = [pb.UploadFile(name="adapter_config.json", size_bytes=2),
                pb.UploadFile(name="adapter_model.safetensors", size_bytes=2 << 20)]
    first = [pb.UploadAdapterRequest(metadata=pb.UploadMetadata(adapter_id="a/too-big", files=declared)),
             pb.UploadAdapterRequest(chunk=pb.FileChunk(name="adapter_config.json", data=b"{}"))]
    try:
        refused = upload_refusal_while_holding(srv.address, first, (("authorization", f"Bearer {TOKENS['a']}"),))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_adapter_bytes" in refused.details()
    finally:
        srv.close()


def test_parallel_uploads_cannot_pass_the_adapter_quota_together(tmp_path) -> None:
    """Each upload's quota check and store are one step per tenant: six uploads at once by a
    tenant allowed two adapters store two, and the others are RESOURCE_EXHAUSTED (all six
    passed the check before any was stored)."""
    folder = write_fake_adapter(tmp_path / "peft")
    srv, _ = _quota_server(tmp_path, TenantLimits(max_adapters=2))
    start, results = threading.Barrier(6), []

    def upload(i: int) -> None:
        with client(srv, "a") as a:
            start.wait()
            try:
                a.upload_adapter(f"a/p{i}", folder)
                results.append("ok")
            except ResourceExhaustedError:
                results.append("refused")

    try:
        threads = [threading.Thread(target=upload, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == ["ok", "ok"] + ["refused"] * 4
        with client(srv, "a") as a:
            assert len(a.list_adapters()) == 2
    finally:
        srv.close()


@pytest.fixture
def store_tenants(tmp_path: Path):
    """A server with tenant tokens whose adapters live in a store sidecar (a real StoreThread)."""
    tokens_path = tmp_path / "tokens.json"
    write_tokens(tokens_path, TOKENS)
    srv = ServerThread(ServerOptions(port=0), security=Security(tokens=TokenFile(str(tokens_path))))
    engine = FakeEngine(tmp_path / "adapters")
    store = StoreThread(tmp_path / "store")
    engine.use_store(StoreClient(store.target, base=FAKE_BASE, retries=0, timeout_s=10))
    srv.attach(engine)
    try:
        yield srv
    finally:
        srv.close()
        engine.adapters.source.close()
        store.close()


def test_the_store_holds_uploads_and_deletes_to_the_callers_rules_too(store_tenants, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """A second line of defence: the server names the caller when it writes to the store
    sidecar, so even if the server's own check let a cross-tenant write through (simulated
    here by disabling it), the store refuses it and nothing changes."""
    from loraplex.inference_server.edge.tenancy import Tenancy

    srv = store_tenants
    folder, other = write_fake_adapter(tmp_path / "peft"), write_fake_adapter(tmp_path / "peft8", rank=8)
    with client(srv, "a") as a:
        kept = a.upload_adapter("a/x", folder)
    monkeypatch.setattr(Tenancy, "check_write", lambda self, context, adapter_id, action: None)
    with client(srv, "b") as b:
        with pytest.raises(PermissionDeniedError, match="tenant 'b' may not delete adapter 'a/x'"):
            b.delete_adapter("a/x")
        with pytest.raises(PermissionDeniedError, match="tenant 'b' may not upload adapter 'a/x'"):
            b.upload_adapter("a/x", other)
        assert b.upload_adapter("b/y", other).rank == 8  # its own namespace still works
    with client(srv, "admin") as admin:
        after = admin.get_adapter("a/x")
        assert (after.version, after.rank) == (kept.version, 4)
        admin.delete_adapter("a/x")  # an admin may, at the store too
        assert [i.adapter_id for i in admin.list_adapters()] == ["b/y"]


def test_the_store_holds_reads_and_lists_to_the_callers_rules_too(store_tenants, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The same second line for reads: GetAdapter and ListAdapters name the caller to the store
    sidecar, so with the server's own read checks disabled (simulated here), tenant b still
    sees neither a's private adapter nor its record, and still sees a's public one."""
    from loraplex.inference_server.edge.tenancy import Tenancy

    srv = store_tenants
    folder = write_fake_adapter(tmp_path / "peft")
    with client(srv, "a") as a:
        a.upload_adapter("a/private", folder)
        a.upload_adapter("a/shared", folder, public=True)
    with client(srv, "b") as b:
        b.upload_adapter("b/own", folder)

    async def no_read_check(self, context, engine, adapter_id):
        return None  # the server reads the record itself, unchecked

    monkeypatch.setattr(Tenancy, "check_read", no_read_check)
    monkeypatch.setattr(Tenancy, "visible", lambda self, context, infos: [i.adapter_id for i in infos])
    with client(srv, "b") as b:
        assert [i.adapter_id for i in b.list_adapters()] == ["a/shared", "b/own"]
        with pytest.raises(NotFoundError, match="a/private"):
            b.get_adapter("a/private")
        assert b.get_adapter("a/shared").public
    with client(srv, "admin") as admin:  # the records are all there
        assert [i.adapter_id for i in admin.list_adapters()] == ["a/private", "a/shared", "b/own"]


def test_a_body_that_does_not_parse_is_unauthenticated_first_without_a_token(tenants) -> None:
    """Authentication comes before decoding: without a token, garbage is UNAUTHENTICATED (an
    anonymous caller learns nothing about the method's input), with one INVALID_ARGUMENT."""
    srv = tenants[0]
    with grpc.insecure_channel(srv.address) as channel:
        call = channel.unary_unary("/loraplex.v1.InferenceService/GetAdapter")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=10, metadata=(("authorization", f"Bearer {TOKENS['a']}"),))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
