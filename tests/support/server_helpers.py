"""Test helpers for the gRPC edge: a small fake engine, a server running in a background
thread (so blocking clients and the CLI can talk to it), free ports, tiny PEFT files."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import InvalidRequestError, ResourceExhaustedError
from loraplex.adapter_store.format.files import AdapterInfo, OpenPut
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.inference_server.engine.info import EngineInfo, EngineStats
from loraplex.inference_server.engine.request import FinishReason, GenerationRequest, Timings, TokenEvent, Usage
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.server.app import GrpcServer, ServerOptions

# The fake engine's "model": 2 layers, hidden 16 (adapters are validated against it).
FAKE_BASE = ModelConfig(model_type="llama", vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=8, name="fake-llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_INFO = EngineInfo(model_name="fake-llama", dtype="float32", device="cpu", max_context_len=256,
                       max_batch_size=4, max_new_tokens_limit=512, vocab_size=300, eos_token_ids=(2,),
                       max_lora_rank=64)


class FakeAdapters:
    """The fake engine's adapters (an engine.api.EdgeAdapters): a source's calls, no pool."""

    def __init__(self, source: LocalAdapterDirectory | StoreClient) -> None:
        self.source = source

    def get(self, adapter_id: str) -> AdapterInfo:
        return self.source.get(adapter_id)

    def list(self) -> list[AdapterInfo]:
        return self.source.list()

    def put(self, adapter_id: str, files: Mapping[str, bytes], public: bool = False) -> AdapterInfo:
        return self.source.put(adapter_id, files, public)

    def delete(self, adapter_id: str) -> None:
        self.source.delete(adapter_id)

    def open_put(self, adapter_id: str, declared: Sequence[DeclaredFile], public: bool = False,
                 timeout_s: float | None = None) -> OpenPut | None:
        if not isinstance(self.source, StoreClient):
            return None
        return self.source.open_put(adapter_id, declared, public, timeout_s)

    def import_s3(self, adapter_id: str, source: str, max_bytes: int) -> AdapterInfo:
        if not isinstance(self.source, StoreClient):
            raise InvalidRequestError("this fake engine has no adapter store", "source")
        return self.source.import_record(adapter_id, source, False, max_bytes).info

    def for_caller(self, caller: Principal) -> FakeAdapters:
        if isinstance(self.source, StoreClient):
            return FakeAdapters(self.source.for_caller(caller))
        return self

    def residency(self) -> dict[str, tuple[bool, bool]]:
        return {}

    def files(self, adapter_id: str) -> Mapping[str, bytes]:
        return self.source.resolve(adapter_id).files

    def load(self, adapter_id: str) -> None:
        self.source.get(adapter_id)  # no pool: a stored adapter is as loaded as it gets


class ByteTokenizer:
    """Token = byte + 3 (ids 0-2 are special); chat = 'role: content' lines + 'assistant:'."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if token_id >= 3 else b""

    chat_template = ""  # no Jinja template: tools are refused, as for any template of no known tool format

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)


class FakeEngine:
    """Streams ``fake_tokens(prompt, adapter, n)`` one token per ``step_s``; honours abort,
    max_new_tokens, a running limit (RESOURCE_EXHAUSTED) and one 'KV block' per running request."""

    TOTAL_BLOCKS = 64
    MAX_LORA = 2  # the adapters its (imaginary) pool holds at once

    def __init__(self, adapter_dir: Path, step_s: float = 0.005, max_running: int = 64) -> None:
        self.info = FAKE_INFO
        self.tokenizer = ByteTokenizer()
        self.adapters = FakeAdapters(LocalAdapterDirectory(adapter_dir, FAKE_BASE, max_rank=64))
        self.step_s = step_s
        self.max_running = max_running
        self.running: set[str] = set()
        self.running_adapters: dict[str, str | None] = {}  # request id -> its adapter
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def stats(self) -> EngineStats:
        adapters = tuple(sorted({a for a in self.running_adapters.values() if a is not None}))
        return EngineStats(num_running=len(self.running), num_waiting=0,
                           free_kv_blocks=self.TOTAL_BLOCKS - len(self.running), total_kv_blocks=self.TOTAL_BLOCKS,
                           resident_adapters=0, preemptions=0, running_adapters=adapters, max_lora=self.MAX_LORA)

    def pool_stats(self) -> None:
        return None

    def use_store(self, client: StoreClient) -> None:
        """Serve adapters from an adapter store instead of the local directory."""
        self.adapters = FakeAdapters(client)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if request.adapter_id is not None:
            self.adapters.get(request.adapter_id)  # AdapterNotFoundError before the first event
        if len(self.running) >= self.max_running:
            raise ResourceExhaustedError(f"request queue is full ({self.max_running} running)")
        if request.stopping.max_new_tokens > self.info.max_new_tokens_limit:
            raise InvalidRequestError("too many", "max_new_tokens")
        self.requests.append(request)
        rid = request.request_id
        self.running.add(rid)
        self.running_adapters[rid] = request.adapter_id
        try:
            tokens = fake_tokens(request.prompt_token_ids, request.adapter_id, request.stopping.max_new_tokens)
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.step_s)
                if rid in self.aborted:
                    yield self._last(request, (), FinishReason.ABORT, i)
                    return
                if i == len(tokens) - 1:
                    yield self._last(request, (token,), FinishReason.LENGTH, i + 1)
                    return
                lp = (-0.5,) if request.sampling.logprobs else None
                top = ({token: -0.5, token + 1: -1.5},) if request.sampling.top_logprobs else None
                yield TokenEvent(rid, (token,), self.tokenizer.decode([token]), logprobs=lp, top_logprobs=top)
        finally:
            self.running.discard(rid)
            self.running_adapters.pop(rid, None)

    def _last(self, request: GenerationRequest, ids: tuple[int, ...], reason: FinishReason, n: int) -> TokenEvent:
        return TokenEvent(request.request_id, ids, self.tokenizer.decode(list(ids)), finish_reason=reason,
                          usage=Usage(len(request.prompt_token_ids), n), timings=Timings(0.001, 0.002, 0.01))


def fake_tokens(prompt: tuple[int, ...], adapter_id: str | None, n: int) -> list[int]:
    """What FakeEngine generates: printable bytes that depend on the prompt and the adapter."""
    salt = sum(map(ord, adapter_id or ""))
    return [3 + 97 + (sum(prompt) + salt + i) % 26 for i in range(n)]


class ServerThread:
    """A GrpcServer on its own event loop in a daemon thread; ``call(coro)`` runs on that loop."""

    def __init__(self, options: ServerOptions, security: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = GrpcServer(options, security=security)
        self.port = self.call(self.server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.http: Any = None

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        async def wrapper() -> Any:
            return fn()
        return self.call(wrapper())

    def attach(self, engine: Any) -> None:
        async def go() -> None:
            await engine.start()
            await self.server.attach_engine(engine)
        self.call(go())

    def start_http(self, port: int = 0, connections: Any = None, **routes: Any) -> str:
        """Open the OpenAI-compatible HTTP edge on this server's state (RouteConfig ``routes``,
        HttpConnectionLimits ``connections``) on ``port`` (0: any free one); returns its base URL
        (``http://127.0.0.1:PORT/v1``)."""
        from loraplex.inference_server.http.app import HttpOptions, HttpServer  # noqa: PLC0415
        from loraplex.inference_server.http.connections import HttpConnectionLimits  # noqa: PLC0415
        from loraplex.inference_server.http.routes import RouteConfig  # noqa: PLC0415

        s = self.server
        options = HttpOptions(port=port, routes=RouteConfig(**routes), connections=connections or HttpConnectionLimits())
        self.http = HttpServer(options, s.state, s.metrics, s.security, s.tenant_metrics)
        port = self.call(self.http.start())
        scheme = "https" if s.security.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{port}/v1"

    def close(self, grace_s: float = 5.0) -> None:
        self.call(self.server.shutdown(grace_s))
        if self.http is not None:
            self.call(self.http.close())
        engine = self.server.state.engine
        if engine is not None:
            self.call(engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class StoreThread:
    """The adapter store sidecar's gRPC server over a local directory, on its own event loop in a
    daemon thread (the fake engine calls its client synchronously from the server's loop)."""

    def __init__(self, folder: Path, base: ModelConfig = FAKE_BASE) -> None:
        from loraplex.adapter_store.factory import build_store  # noqa: PLC0415
        from loraplex.adapter_store.server import StoreServer  # noqa: PLC0415
        from loraplex.adapter_store.settings import StoreSettings  # noqa: PLC0415

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = StoreServer(build_store(StoreSettings(local_dir=str(folder)), base=base), "127.0.0.1:0")
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.target = f"127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _safetensors(tensors: dict[str, tuple[list[int], bytes]], dtype: str = "F32") -> bytes:
    header, offset, blobs = {}, 0, []
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def write_fake_adapter(folder: Path, rank: int = 4, base: ModelConfig = FAKE_BASE, modules: tuple[str, ...] = (
        "q_proj", "v_proj"), alpha: float = 8.0) -> Path:
    """A valid PEFT LoRA folder for ``base`` (float32 weights, deterministic values)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = base.projection_shapes()
    tensors = {}
    for layer in range(base.num_layers):
        for module in modules:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = ([rank, fan_in], struct.pack(f"<{rank * fan_in}f",
                                                                                *([0.01] * (rank * fan_in))))
            tensors[f"{prefix}.lora_B.weight"] = ([fan_out, rank], struct.pack(f"<{rank * fan_out}f",
                                                                                 *([0.02] * (rank * fan_out))))
    (folder / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
              "bias": "none", "base_model_name_or_path": base.name}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def fake_server_address(tmp_path: Path) -> Iterator[str]:
    """A server over a FakeEngine whose adapters live under ``tmp_path``: yields its address
    (for a fixture: ``yield from fake_server_address(tmp_path)``)."""
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=6))
    srv.attach(FakeEngine(tmp_path / "store"))
    yield srv.address
    srv.close()


def upload_refusal_while_holding(address: str, first: list[Any], metadata: tuple = ()) -> Any:
    """The grpc.RpcError an UploadAdapter call ends with while its client, having sent ``first``
    (its metadata and some chunks), still holds the rest: a server that waited for every byte
    before refusing fails this with a timeout. ``metadata``: the call's (a tenant's token)."""
    import grpc  # noqa: PLC0415

    from loraplex.v1 import inference_pb2_grpc  # noqa: PLC0415

    held = threading.Event()

    def requests() -> Iterator[Any]:
        yield from first
        held.wait(30)  # the rest would be sent only after the answer came

    with grpc.insecure_channel(address) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).UploadAdapter.future(
            requests(), metadata=metadata, timeout=30)
        try:
            call.result(timeout=10)
        except grpc.RpcError as refused:
            return refused
        finally:
            held.set()
    raise AssertionError("the upload was accepted")
