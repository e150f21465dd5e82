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


def serve_with_tokenizer(tok, tmp_path_factory, seed: int, new_tokens: int, config: EngineConfig
                         ) -> tuple[ServerThread, AsyncEngine, str]:
    """A tiny random Llama saved with ``tok`` (a transformers tokenizer carrying the chat template
    under test) behind both edges: (server, engine, the HTTP base URL)."""
    import transformers  # noqa: PLC0415

    from tiny_models import save_tiny_model  # noqa: PLC0415

    tok_dir = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(tok_dir)
    model = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=1024, vocab_size=len(tok))
    folder = save_tiny_model(transformers.LlamaForCausalLM, model, tok_dir, tmp_path_factory.mktemp("model"), seed=seed)
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=new_tokens))
    url = srv.start_http(default_max_new_tokens=new_tokens)
    engine = build_engine(AsyncEngine, config, ModelSource(path=str(folder)), tmp_path_factory.mktemp("adapters"),
                          progress=False)
    srv.attach(engine)
    return srv, engine, url
