"""The engine with its adapters in the adapter store sidecar: uploads go through the store,
and a re-upload through another replica's client reaches this engine by the store's Watch,
which drops the stale copy from the pool and the host tier."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from lora_helpers import collect, greedy_request, make_peft_adapter
from store_services import StoreProcess

from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.errors import AdapterNotFoundError
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource

pytestmark = pytest.mark.slow


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def test_store_backed_engine_follows_reuploads_from_another_replica(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    kwargs = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    v1 = _files(make_peft_adapter(hf_model, tmp_path / "v1", kwargs, seed=1, std=0.1))
    v2 = _files(make_peft_adapter(hf_model, tmp_path / "v2", kwargs, seed=2, std=0.1))
    store = StoreProcess(["--local-dir", str(tmp_path / "blobs"), "--metrics-port", "0"], tmp_path / "store.log")
    other_replica = StoreClient(store.target)
    try:
        config = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)
        engine = build_engine(
            AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), lambda base: StoreClient(store.target, base=base),
            progress=False,
        )
        prompt = engine.tokenizer.encode("Tell me about the sea")

        async def generate(rid: str) -> list[int]:
            return [t for e in await collect(engine, greedy_request(rid, prompt, "acme/sea", 12)) for t in e.token_ids]

        async def main() -> tuple[list[int], list[int], list[int]]:
            await engine.start()
            try:
                with pytest.raises(AdapterNotFoundError):
                    await generate("missing")
                stored = engine.adapters.put("acme/sea", v1, public=True)  # the upload path, through the store
                assert stored.public and engine.adapters.get("acme/sea").public  # kept in the store's record
                first = await generate("a")
                assert [i.adapter_id for i in engine.adapters.list()] == ["acme/sea"]
                await asyncio.to_thread(other_replica.put, "acme/sea", v2)  # another replica
                for _ in range(100):  # the Watch event drops our copies
                    if "acme/sea" not in engine._manager.held_versions():
                        break
                    await asyncio.sleep(0.05)
                second = await generate("b")
                await asyncio.to_thread(other_replica.delete, "acme/sea")
                for _ in range(100):
                    if "acme/sea" not in engine._manager.held_versions():
                        break
                    await asyncio.sleep(0.05)
                with pytest.raises(AdapterNotFoundError):
                    await generate("c")
                return first, second
            finally:
                await engine.shutdown()

        first, second = asyncio.run(main())
        assert first != second, "the re-uploaded adapter must be served"
        fresh = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)),
                                  lambda base: StoreClient(store.target, base=base), progress=False)
        assert not fresh.adapters.put("acme/sea", v2).public and not fresh.adapters.get("acme/sea").public

        async def again() -> list[int]:
            await fresh.start()
            try:
                return [t for e in await collect(fresh, greedy_request("d", prompt, "acme/sea", 12)) for t in e.token_ids]
            finally:
                await fresh.shutdown()

        assert asyncio.run(again()) == second
    finally:
        other_replica.close()
        store.stop()


def test_server_with_store_sidecar_serves_uploads_through_the_store(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """loraplex-server --adapter-store: the public upload/list/get/delete RPCs go through the
    sidecar, and a generation with an uploaded adapter uses it."""
    from loraplex.clients import LoraplexClient
    from loraplex.clients.errors import NotFoundError
    from server_process import start_server, stop
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    folder = make_peft_adapter(hf_model, tmp_path / "peft", dict(r=8, target_modules=["q_proj", "v_proj"]),
                               seed=5, std=0.1)
    store = StoreProcess(["--local-dir", str(tmp_path / "blobs"), "--metrics-port", "0"], tmp_path / "store.log")
    proc, address = start_server(tiny_llama_dir, tmp_path, "--adapter-store", store.target)
    try:
        with LoraplexClient(address, timeout=10) as client, StoreClient(store.target) as direct:
            client.wait_until_serving(120)
            client.upload_adapter("acme/sea", folder)
            assert [a.adapter_id for a in direct.list()] == ["acme/sea"], "the upload landed in the store"
            assert not (tmp_path / "adapters" / "acme").exists(), "nothing in the local adapter directory"
            base = client.generate_text("Tell me about the sea", max_new_tokens=8, ignore_eos=True)
            tuned = client.generate_text("Tell me about the sea", adapter="acme/sea", max_new_tokens=8,
                                         ignore_eos=True)
            assert tuned.token_ids != base.token_ids
            assert client.get_adapter("acme/sea").version == direct.get("acme/sea").version
            client.delete_adapter("acme/sea")
            with pytest.raises(AdapterNotFoundError):
                direct.get("acme/sea")
            with pytest.raises(NotFoundError):
                client.generate_text("Hi", adapter="acme/sea", max_new_tokens=4)
    finally:
        stop(proc)
        store.stop()

