"""Adapter management over gRPC (fake engine, real local adapter directory): upload, list, get,
delete; bad uploads are refused with a precise status and leave nothing behind."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from server_helpers import FAKE_BASE, FakeEngine, ServerThread, write_fake_adapter


@pytest.fixture
def served(tmp_path: Path):
    srv = ServerThread(ServerOptions(port=0, max_upload_bytes=100_000))
    engine = FakeEngine(tmp_path / "store")
    srv.attach(engine)
    with LoraplexClient(srv.address, timeout=10) as client:
        yield srv, engine, client, tmp_path
    srv.close()


def stored_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_upload_then_list_get_generate_delete(served) -> None:
    srv, engine, client, tmp = served
    folder = write_fake_adapter(tmp / "src" / "pirate", rank=4)
    seen: list[tuple[int, int]] = []
    info = client.upload_adapter("acme/pirate", folder, progress=lambda sent, total: seen.append((sent, total)))
    total = sum(f.stat().st_size for f in folder.iterdir())
    assert seen and seen[-1] == (total, total) and [s for s, _ in seen] == sorted(s for s, _ in seen)
    weights = (folder / "adapter_model.safetensors").read_bytes()
    assert info.adapter_id == "acme/pirate" and info.rank == 4 and info.lora_alpha == 8.0
    assert info.sha256 == hashlib.sha256(weights).hexdigest() and info.dtype == "F32"
    assert info.target_modules == ("q_proj", "v_proj") and info.size_bytes == len(weights)
    assert info.created_at > 0
    assert [a.adapter_id for a in client.list_adapters()] == ["acme/pirate"]
    assert client.get_adapter("acme/pirate").version == info.version
    assert client.generate_text("x", adapter="acme/pirate", max_new_tokens=3).finish_reason == "length"
    client.delete_adapter("acme/pirate")
    with pytest.raises(NotFoundError):
        client.generate_text("x", adapter="acme/pirate")
    with pytest.raises(NotFoundError):
        client.delete_adapter("acme/pirate")
    assert client.list_adapters() == []


def test_list_pages_and_prefix(served) -> None:
    srv, engine, client, tmp = served
    folder = write_fake_adapter(tmp / "src" / "a", rank=2)
    ids = ["a1", "t/x", "t/y", "t/z"]
    for adapter_id in ids:
        client.upload_adapter(adapter_id, folder)
    assert [a.adapter_id for a in client.list_adapters()] == ids
    assert [a.adapter_id for a in client.list_adapters("t/")] == ["t/x", "t/y", "t/z"]
    stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(srv.address))
    page = stub.ListAdapters(pb.ListAdaptersRequest(page_size=2), timeout=5)
    assert [a.adapter_id for a in page.adapters] == ["a1", "t/x"] and page.next_page_token
    page = stub.ListAdapters(pb.ListAdaptersRequest(page_size=2, page_token=page.next_page_token), timeout=5)
    assert [a.adapter_id for a in page.adapters] == ["t/y", "t/z"] and not page.next_page_token


def test_reupload_makes_a_new_version(served) -> None:
    srv, engine, client, tmp = served
    first = client.upload_adapter("v", write_fake_adapter(tmp / "one", rank=2))
    second = client.upload_adapter("v", write_fake_adapter(tmp / "two", rank=4))
    assert first.version != second.version and client.get_adapter("v").rank == 4


@pytest.mark.parametrize("breakage, match", [
    ("corrupt_weights", "safetensors"),
    ("bad_json", "not valid JSON"),
    ("dora", "DoRA"),
    ("wrong_base", "shape"),
])
def test_bad_adapter_is_invalid_argument_and_nothing_is_stored(served, breakage: str, match: str) -> None:
    srv, engine, client, tmp = served
    folder = write_fake_adapter(tmp / "bad", rank=4)
    if breakage == "corrupt_weights":
        (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    elif breakage == "bad_json":
        (folder / "adapter_config.json").write_text("{not json")
    elif breakage == "dora":
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
    else:
        write_fake_adapter(folder, rank=4, base=replace(FAKE_BASE, hidden_size=24))
    with pytest.raises(InvalidArgumentError, match=match):
        client.upload_adapter("bad", folder)
    assert client.list_adapters() == []
    assert [f for f in stored_files(tmp / "store") if not f.startswith(".staging")] == []


def _raw_upload(srv: ServerThread, messages: list[pb.UploadAdapterRequest]) -> grpc.RpcError:
    stub = pb_grpc.InferenceServiceStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.UploadAdapter(iter(messages), timeout=5)
    return info.value


def _meta(adapter_id: str = "x", **sizes: int) -> pb.UploadAdapterRequest:
    files = [pb.UploadFile(name=n.replace("__", "."), size_bytes=s) for n, s in sizes.items()]
    return pb.UploadAdapterRequest(metadata=pb.UploadMetadata(adapter_id=adapter_id, files=files))


def _chunk(name: str, data: bytes) -> pb.UploadAdapterRequest:
    return pb.UploadAdapterRequest(chunk=pb.FileChunk(name=name, data=data))


@pytest.mark.parametrize("messages, code, field", [
    ([], grpc.StatusCode.INVALID_ARGUMENT, "metadata"),
    ([_chunk("a", b"1")], grpc.StatusCode.INVALID_ARGUMENT, "metadata"),
    ([_meta(a=1), _meta(a=1)], grpc.StatusCode.INVALID_ARGUMENT, "metadata"),
    ([_meta("../up", a=1)], grpc.StatusCode.INVALID_ARGUMENT, "metadata.adapter_id"),
    ([_meta(**{"x/y": 1})], grpc.StatusCode.INVALID_ARGUMENT, "metadata.files.name"),
    ([_meta(a=10), _chunk("a", b"123")], grpc.StatusCode.INVALID_ARGUMENT, "metadata.files.size_bytes"),
    ([_meta(a=2), _chunk("a", b"123")], grpc.StatusCode.INVALID_ARGUMENT, "chunk.data"),
    ([_meta(a=2), _chunk("b", b"12")], grpc.StatusCode.INVALID_ARGUMENT, "chunk.name"),
    ([_meta(a=300_000)], grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    # the served model's name: it would stand twice in /v1/models, HTTP reading it as the base model
    ([_meta("fake-llama", a=1)], grpc.StatusCode.INVALID_ARGUMENT, "metadata.adapter_id"),
])
def test_malformed_upload_streams(served, messages, code, field) -> None:
    srv, engine, client, tmp = served
    error = _raw_upload(srv, messages)
    assert error.code() == code, error.details()
    got_field = dict(error.trailing_metadata() or ()).get("loraplex-field")
    assert got_field == field
    assert client.list_adapters() == []


def test_checksum_mismatch_is_refused(served) -> None:
    srv, engine, client, tmp = served
    meta = pb.UploadAdapterRequest(metadata=pb.UploadMetadata(adapter_id="x", files=[
        pb.UploadFile(name="adapter_config.json", size_bytes=2, sha256="0" * 64)]))
    error = _raw_upload(srv, [meta, _chunk("adapter_config.json", b"{}")])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in error.details()


def test_upload_over_the_size_limit_is_resource_exhausted(served) -> None:
    srv, engine, client, tmp = served
    folder = write_fake_adapter(tmp / "big", rank=64, modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"))
    with pytest.raises(ResourceExhaustedError, match="limit of 100000 bytes"):
        client.upload_adapter("big", folder)


def test_client_refuses_pickle_only_folders_before_sending(served, tmp_path: Path) -> None:
    srv, engine, client, tmp = served
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="safe_serialization"):
        client.upload_adapter("p", folder)
