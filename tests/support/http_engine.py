"""The real engine (tiny Llama) behind both edges in one server thread, for HTTP tests."""

from __future__ import annotations

from pathlib import Path
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from server_helpers import ServerThread


NEW_TOKENS = 12


def _serve(model: ModelSource, adapters: Path) -> tuple[ServerThread, AsyncEngine, str]:
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=NEW_TOKENS))
    url = srv.start_http(default_max_new_tokens=NEW_TOKENS)
    config = EngineConfig(num_kv_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
    engine = build_engine(AsyncEngine, config, model, adapters, progress=False)
    srv.attach(engine)
    return srv, engine, url
