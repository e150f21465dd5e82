"""Bad inputs give a clear error before any work, and the engine keeps serving the others."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from lora_helpers import collect, greedy_request, load_engine, make_peft_adapter, tokens_of

from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError, InvalidRequestError
from loraplex.inference_server.engine.request import (FinishReason, GenerationRequest, SamplingParams,
                                                      StoppingCriteria)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("bad-adapters")
    good = make_peft_adapter(hf_model, root / "good", dict(r=4, target_modules=["q_proj"]), seed=0, std=0.1)
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    other = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    make_peft_adapter(other, root / "mismatched", dict(r=4, target_modules=["q_proj"]), seed=1, std=0.1)
    dora = root / "dora"
    shutil.copytree(good, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    pickled = root / "pickled"
    shutil.copytree(good, pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    return root


CASES = {
    "unknown adapter": (lambda p: greedy_request("x", p, "nope", 4), AdapterNotFoundError, "not found"),
    "corrupt safetensors": (lambda p: greedy_request("x", p, "corrupt", 4), AdapterValidationError, "truncated"),
    "mismatched shapes": (lambda p: greedy_request("x", p, "mismatched", 4), AdapterValidationError, "q_proj"),
    "DoRA": (lambda p: greedy_request("x", p, "dora", 4), AdapterValidationError, "DoRA"),
    "pickle weights": (lambda p: greedy_request("x", p, "pickled", 4), AdapterValidationError, "pickle"),
    "prompt too long": (lambda p: greedy_request("x", p * 200, None, 4), InvalidRequestError, "context window"),
    "token outside vocab": (lambda p: greedy_request("x", [10**6], None, 4), InvalidRequestError, "vocabulary"),
    # one past the vocabulary would land on the next row's logits (another request's tokens)
    "logit_bias outside vocab": (lambda p: GenerationRequest(
        "x", tuple(p), None, SamplingParams(logit_bias=((49152 + 7, 100.0),)), StoppingCriteria(max_new_tokens=4)),
        InvalidRequestError, "token id 49159 is outside the vocabulary"),
    "stop_token_ids outside vocab": (lambda p: greedy_request("x", p, None, 4, stop_token_ids=(49152,), min_tokens=2),
                                     InvalidRequestError, "token id 49152 is outside the vocabulary"),
}
FIELDS = {"prompt too long": "prompt", "token outside vocab": "prompt_token_ids", "logit_bias outside vocab": "logit_bias",
          "stop_token_ids outside vocab": "stop_token_ids"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_fails_cleanly_while_others_are_served(
    case: str, tiny_llama_dir: Path, adapters: Path
) -> None:
    make, error, words = CASES[case]
    engine = load_engine(tiny_llama_dir, adapters, max_model_len=256)
    prompt = engine.tokenizer.encode("Hello there")

    async def main():
        await engine.start()
        good = asyncio.create_task(collect(engine, greedy_request("ok", prompt, "good", 16)))
        with pytest.raises(error, match=words) as info:
            await collect(engine, make(prompt))
        events = await good
        await engine.shutdown()
        return events, info.value

    events, raised = asyncio.run(main())
    assert events[-1].finish_reason is FinishReason.LENGTH and len(tokens_of(events)) == 16
    if case in FIELDS:
        assert raised.field == FIELDS[case]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"top_logprobs": 50}, "top_logprobs"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_strings": ("",)}, "stop_strings"), ({"stop_token_ids": (-1,)}, "stop_token_ids")],
)
def test_invalid_stopping_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StoppingCriteria(**kwargs)
    assert info.value.field == field


def test_max_new_tokens_above_the_server_limit_is_refused(tiny_llama_dir: Path, adapters: Path) -> None:
    engine = load_engine(tiny_llama_dir, adapters, max_new_tokens_limit=10)

    async def main():
        await engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="at most 10"):
                await collect(engine, greedy_request("big", [1, 2, 3], None, 11))
        finally:
            await engine.shutdown()

    asyncio.run(main())
