"""An upload is checked once per trust boundary and streamed through the server (#43).

The GPU server checks what its client sent (declared files, sizes, digests, its limits, the
tenant's rights) as the chunks pass, and the upload's head against its base model (the config and
the weights' safetensors header, read once, as they pass: a misfit is refused before its weights
follow); it streams the bytes on to the store sidecar without holding the adapter. The store, the
durable gate, parses the whole of it once, against the base model and rank cap the server sends
with the upload (so a store that was never told the base still refuses a misfit). A real store
process and the real gRPC server; the parses of this process (the server's) are counted at the
safetensors header read. The store refuses what it must before the client has sent everything,
and stores nothing from an upload that fails or is abandoned on its way."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import grpc
import pytest

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError, UnavailableError
from loraplex.adapter_store.format import peft_format
from loraplex.clients import LoraplexClient
from loraplex.clients.errors import InvalidArgumentError
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as ipb, inference_pb2_grpc
from lora_helpers import make_test_adapters
from server_helpers import ServerThread, upload_refusal_while_holding, write_fake_adapter
from store_services import StoreProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(the server, its engine's base model config, the store's target, PEFT adapters folder, the
    engine); the store keeps blobs in a local folder, takes adapters up to 1 MiB and has no
    --base-config."""
    tmp = tmp_path_factory.mktemp("upload-parses")
    peft = make_test_adapters(tiny_llama_dir, tmp / "peft")
    store = StoreProcess(["--local-dir", str(tmp / "blobs"), "--metrics-port", "0", "--max-adapter-mib", "1"],
                         tmp / "store.log")
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    try:
        config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
        target = store.target
        engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)),
                              lambda base: StoreClient(target, base=base), progress=False)
        srv.attach(engine)
        yield srv, engine.adapters._base, target, peft, engine
    finally:
        srv.close()
        store.stop()


@pytest.fixture
def header_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every parse of an adapter in this process reads its safetensors header once: counted."""
    reads: list[int] = []
    real = peft_format.read_header

    def counted(raw: bytes, *args):
        reads.append(len(raw))
        return real(raw, *args)

    monkeypatch.setattr(peft_format, "read_header", counted)
    return reads


def test_an_upload_streams_through_the_server_which_reads_only_its_head(stack, header_reads: list[int]) -> None:
    srv, _, target, peft, _ = stack
    with LoraplexClient(srv.address, timeout=60) as client:
        info = client.upload_adapter("acme/once", peft / "attn-r8")
    weights = (peft / "attn-r8" / "adapter_model.safetensors").stat().st_size
    assert len(header_reads) == 1 and header_reads[0] < weights  # the head, as it passed; the store parsed the rest
    with StoreClient(target) as store:
        record, files = store.fetch("acme/once")
    assert record.info.version == info.version
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert all(data == (peft / "attn-r8" / name).read_bytes() for name, data in files.items())


def test_a_misfit_upload_is_refused_by_its_head_in_the_server(stack, tmp_path: Path,
                                                              header_reads: list[int]) -> None:
    srv, _, target, _, _ = stack
    with LoraplexClient(srv.address, timeout=60) as client:
        with pytest.raises(InvalidArgumentError, match="shape"):
            client.upload_adapter("acme/misfit-via-server", write_fake_adapter(tmp_path / "misfit"))
    assert len(header_reads) == 1
    with StoreClient(target) as store, pytest.raises(AdapterNotFoundError):
        store.stat("acme/misfit-via-server")


def _metadata(adapter_id: str, files: dict[str, bytes], sha256: dict[str, str] | None = None) -> ipb.UploadAdapterRequest:
    declared = [ipb.UploadFile(name=n, size_bytes=len(b), sha256=(sha256 or {}).get(n, "")) for n, b in files.items()]
    return ipb.UploadAdapterRequest(metadata=ipb.UploadMetadata(adapter_id=adapter_id, files=declared))


def _chunks(files: dict[str, bytes], size: int = 64 << 10):
    for name, data in files.items():
        for start in range(0, len(data), size):
            yield ipb.UploadAdapterRequest(chunk=ipb.FileChunk(name=name, data=data[start : start + size]))


def test_the_store_refuses_at_the_metadata_before_the_bytes_are_sent(stack) -> None:
    """2 MiB declared, the store takes 1: the refusal reaches the client while it still holds
    every byte after its first chunk (a server that buffered the upload would wait for them)."""
    srv = stack[0]
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\0" * (2 << 20)}
    refused = upload_refusal_while_holding(srv.address, [_metadata("acme/too-big", files), next(_chunks(files))])
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the store's limit" in refused.details()


def test_a_wrong_digest_or_an_abandoned_upload_stores_nothing(stack) -> None:
    srv, _, target, peft, _ = stack
    files = {n: (peft / "attn-r8" / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    wrong = {n: hashlib.sha256(b + b"!").hexdigest() for n, b in files.items()}
    with grpc.insecure_channel(srv.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.UploadAdapter(iter([_metadata("acme/wrong-digest", files, wrong), *_chunks(files)]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sha256 does not match" in refused.value.details()
        held = threading.Event()

        def abandoned():
            yield _metadata("acme/abandoned", files)
            yield next(_chunks(files, size=100))
            held.wait(30)

        call = stub.UploadAdapter.future(abandoned(), timeout=30)
        time.sleep(0.5)
        call.cancel()
        held.set()
    with StoreClient(target) as store:
        for adapter_id in ("acme/wrong-digest", "acme/abandoned"):
            with pytest.raises(AdapterNotFoundError):
                store.stat(adapter_id)


def test_files_the_server_reads_itself_are_checked_by_the_store_alone(stack, tmp_path: Path,
                                                                     header_reads: list[int]) -> None:
    """What the HTTP edge's load_lora_adapter stores (a folder on the server, a copy): the same one
    check, in the store, against this server's base."""
    _, _, target, peft, engine = stack
    files = {n: (peft / "attn-r8" / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    assert engine.adapters.put("acme/copied", files).adapter_id == "acme/copied"
    misfit = write_fake_adapter(tmp_path / "misfit")
    with pytest.raises(AdapterValidationError, match="shape"):
        engine.adapters.put("acme/misfit-copy", {f.name: f.read_bytes() for f in misfit.iterdir()})
    assert header_reads == []
    with StoreClient(target) as store, pytest.raises(AdapterNotFoundError):
        store.stat("acme/misfit-copy")


def test_the_store_checks_the_servers_base_it_was_never_told(stack, tmp_path: Path, header_reads: list[int]) -> None:
    """The store has no --base-config; the base travels with the Put, so the store refuses an
    adapter of another model's shapes in its own parse (none happened in this process)."""
    _, base, target, _, _ = stack
    misfit = write_fake_adapter(tmp_path / "misfit")
    files = {f.name: f.read_bytes() for f in misfit.iterdir()}
    with StoreClient(target, base=base) as store:
        with pytest.raises(AdapterValidationError, match="shape"):
            store.put("acme/misfit", files)
        assert header_reads == []
        with pytest.raises(AdapterNotFoundError):
            store.stat("acme/misfit")
    with StoreClient(target) as unbound:  # without a base the store's own checks only: it fits no model here
        assert unbound.put("acme/misfit", files).adapter_id == "acme/misfit"


def test_an_open_put_aborted_midway_stores_nothing_and_says_so(stack) -> None:
    """The store client's side of the stream (adapter_store/put_stream.py), as the server drives it."""
    _, _, target, peft, _ = stack
    files = {n: (peft / "attn-r8" / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    declared = [DeclaredFile(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()]
    with StoreClient(target) as store:
        put = store.open_put("acme/aborted", declared, timeout_s=30)
        put.send(files["adapter_config.json"])
        put.abort()
        with pytest.raises(UnavailableError, match="abandoned; nothing was stored"):
            put.send(files["adapter_model.safetensors"])
        with pytest.raises(AdapterNotFoundError):
            store.stat("acme/aborted")
        too_big = store.open_put("acme/too-big-direct", [DeclaredFile("adapter_model.safetensors", 2 << 20)])
        answered = threading.Event()
        too_big.on_answer(answered.set)
        assert answered.wait(10)  # refused at the metadata: nothing had to be sent
        with pytest.raises(AdapterValidationError, match="over the store's limit"):
            too_big.send(b"\0" * 1024)
