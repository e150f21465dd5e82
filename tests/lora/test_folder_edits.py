"""A folder of a local adapter directory edited by hand while the server runs (a new
``save_pretrained`` into it, or the folder removed): the adapter pool drops its copy within a
poll (inference_server/lora/folder_watcher.py), so the next request generates with what the
folder holds now, the tokens of the same weights under a fresh id, or is refused as not found.
Before, a resident copy kept serving the old weights while GetAdapter reported the new version."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import torch

from lora_helpers import collect, greedy_request, load_engine, make_peft_adapter, tokens_of

from loraplex.adapter_store.errors import AdapterNotFoundError
from loraplex.adapter_store.format.files import ADAPTER_FILES

CONFIG = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])


async def _held_until(engine, adapter_id: str, held: bool, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while (adapter_id in engine._manager.held_versions()) != held:
        assert time.monotonic() < end, f"{adapter_id} still {'not ' if held else ''}held after {timeout_s} s"
        await asyncio.sleep(0.05)


def test_a_folder_replaced_or_removed_by_hand_is_served_as_it_is_now(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path / "adapters"
    make_peft_adapter(hf_model, root / "edited", CONFIG, seed=1, std=0.2)
    make_peft_adapter(hf_model, root / "fresh", CONFIG, seed=2, std=0.2)  # what "edited" becomes
    engine = load_engine(tiny_llama_dir, root)
    prompt = engine.tokenizer.encode("The weather today")

    async def tokens(adapter_id: str, rid: str) -> list[int]:
        return tokens_of(await collect(engine, greedy_request(rid, prompt, adapter_id, 10)))

    async def main() -> None:
        await engine.start()
        try:
            old, fresh = await tokens("edited", "old"), await tokens("fresh", "fresh")
            assert old != fresh and "edited" in engine._manager.held_versions()
            for name in ADAPTER_FILES:  # rewritten in place, as save_pretrained into the folder does
                shutil.copyfile(root / "fresh" / name, root / "edited" / name)
            await _held_until(engine, "edited", held=False)
            assert engine.adapters.get("edited").version == engine.adapters.get("fresh").version
            assert await tokens("edited", "new") == fresh
            shutil.rmtree(root / "edited")
            await _held_until(engine, "edited", held=False)
            with pytest.raises(AdapterNotFoundError):
                await tokens("edited", "gone")
        finally:
            await engine.shutdown()

    asyncio.run(main())
