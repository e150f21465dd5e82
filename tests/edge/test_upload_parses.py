"""An upload is checked once per trust boundary (#43): the GPU server, which knows its base model,
parses it once; the store sidecar, the durable gate, parses it once, against the base model the
server sends with the upload (so a store that was never told the base still refuses a misfit).
The store client in the server parses nothing. A real store process and the real gRPC server;
the parses of this process (the server's) are counted at the safetensors header read."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError
from loraplex.adapter_store.format import peft_format
from loraplex.clients import LoraplexClient
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from lora_helpers import make_test_adapters
from server_helpers import ServerThread, write_fake_adapter
from store_services import StoreProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(the server, its engine's base model config, the store's target, PEFT adapters folder); the
    store keeps blobs in a local folder and has no --base-config."""
    tmp = tmp_path_factory.mktemp("upload-parses")
    peft = make_test_adapters(tiny_llama_dir, tmp / "peft")
    store = StoreProcess(["--local-dir", str(tmp / "blobs"), "--metrics-port", "0"], tmp / "store.log")
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=4))
    try:
        config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
        target = store.target
        engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)),
                              lambda base: StoreClient(target, base=base), progress=False)
        srv.attach(engine)
        yield srv, engine.adapters._base, target, peft
    finally:
        srv.close()
        store.stop()


@pytest.fixture
def header_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every parse of an adapter in this process reads its safetensors header once: counted."""
    reads: list[int] = []
    real = peft_format.read_header

    def counted(raw: bytes):
        reads.append(len(raw))
        return real(raw)

    monkeypatch.setattr(peft_format, "read_header", counted)
    return reads


def test_an_upload_is_parsed_once_by_the_server(stack, header_reads: list[int]) -> None:
    srv, _, target, peft = stack
    with LoraplexClient(srv.address, timeout=60) as client:
        info = client.upload_adapter("acme/once", peft / "attn-r8")
    assert len(header_reads) == 1  # the server's check; its store client sends the bytes on unparsed
    with StoreClient(target) as store:
        assert store.stat("acme/once").info.version == info.version


def test_the_store_checks_the_servers_base_it_was_never_told(stack, tmp_path: Path, header_reads: list[int]) -> None:
    """The store has no --base-config; the base travels with the Put, so the store refuses an
    adapter of another model's shapes in its own parse (none happened in this process)."""
    _, base, target, _ = stack
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
