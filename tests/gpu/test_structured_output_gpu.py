"""Structured output on CUDA (#41 item 4): the constrained rows' masks reach the device and are
applied without reading anything back (torch's sync debug mode turns a synchronizing call into an
error); the engine with CUDA graphs and launch-ahead gives the eager engine's tokens for a batch
mixing constrained (json_schema, json_object, a tool call) and free requests, every constrained
output a path through its grammar, and launched steps still run (a constrained row waits for its
token to be read before its next mask, the others are not held back); and SmolLM2 in bfloat16 answers
a JSON schema with a valid document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplex.inference_server.engine.grammar import GrammarState, MaskFiller
from loraplex.inference_server.engine.request import GenerationRequest, GrammarSpec, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sampler import SampleRow, apply_penalties, choose
from lora_helpers import load_engine, run_all, text_of, tokens_of

CUDA = torch.device("cuda")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
TOOL = json.dumps({"type": "array", "minItems": 1, "items": {
    "type": "object", "properties": {"name": {"const": "f"}, "arguments": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    "required": ["name", "arguments"], "additionalProperties": False}})
SPECS = {"schema": GrammarSpec("json_schema", json.dumps(SCHEMA)), "object": GrammarSpec("json_object"),
         "tool": GrammarSpec("tagged_json", TOOL, "<tool_call>", "</tool_call>")}


@pytest.fixture(scope="module")
def no_adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("no-adapters")


def test_masks_reach_the_device_and_apply_without_a_sync(tiny_llama_dir: Path, no_adapters: Path) -> None:
    engine = load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype="bfloat16", max_num_seqs=4)
    grammars = engine._core.grammars
    states = [None, GrammarState(grammars.compile(SPECS["schema"]), [2]), None,
              GrammarState(grammars.compile(SPECS["object"]), [2])]
    vocab = engine.info.vocab_size
    logits = torch.randn(4, vocab, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(0))
    rows = [SampleRow(SamplingParams(), (), None) for _ in range(4)]
    filler = MaskFiller()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks = filler.masks(states, vocab, CUDA)
        tokens = choose(apply_penalties(logits, rows, masks=masks), rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert masks.bitmask.device.type == CUDA.type and masks.rows.tolist() == [1, 3]
    chosen = tokens.tolist()
    assert chosen[0] == int(logits[0].argmax()) and chosen[2] == int(logits[2].argmax())  # free rows untouched
    text = engine.tokenizer.decode([chosen[1]])
    assert text.startswith("{") and engine.tokenizer.decode([chosen[3]]).startswith("{")
    assert states[1].accept(chosen[1]) and states[3].accept(chosen[3])


def _requests(engine) -> list[GenerationRequest]:
    enc = engine.tokenizer.encode
    out = []
    for i, (name, spec) in enumerate([("schema", SPECS["schema"]), ("free-a", None), ("object", SPECS["object"]),
                                      ("free-b", None), ("tool", SPECS["tool"]), ("free-c", None)]):
        stopping = StoppingCriteria(max_new_tokens=32) if spec else StoppingCriteria(max_new_tokens=24 + i,
                                                                                      ignore_eos=True)
        sampling = SamplingParams(temperature=0.8, seed=i) if i % 4 == 0 else SamplingParams()
        out.append(GenerationRequest(name, tuple(enc(f"Request {i}: some JSON please")), None, sampling, stopping,
                                     grammar=spec))
    return out


def test_graphs_and_launch_ahead_give_the_eager_outputs_with_constrained_rows(tiny_llama_dir: Path,
                                                                             no_adapters: Path) -> None:
    eager = load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype="bfloat16", enforce_eager=True,
                        max_num_seqs=8)
    fast = load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype="bfloat16", max_num_seqs=8)
    assert fast._core._launch_ahead
    expected = run_all(eager, _requests(eager))
    got = run_all(fast, _requests(fast))
    assert fast._core.runner.graphs.replays >= 10
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    grammars = fast._core.grammars
    for request in _requests(fast):
        events = got[request.request_id]
        assert events[-1].finish_reason.value in ("stop", "length"), request.request_id
        if request.grammar is not None:
            state = GrammarState(grammars.compile(request.grammar), [2])
            assert all(state.accept(t) for t in tokens_of(events)), request.request_id
    free = [r for r in _requests(fast) if r.grammar is None]
    alone = run_all(load_engine(tiny_llama_dir, no_adapters, device="cuda", dtype="bfloat16", max_num_seqs=8), free)
    assert {r.request_id: tokens_of(alone[r.request_id]) for r in free} == {
        r.request_id: tokens_of(got[r.request_id]) for r in free}


def test_smollm2_answers_a_json_schema_on_the_gpu(carried_gguf: str, no_adapters: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    engine = load_engine(carried_gguf, no_adapters, device="cuda", dtype="bfloat16", max_num_seqs=8)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    requests = [GenerationRequest(f"p{i}", tuple(prompt), None, SamplingParams(temperature=0.7, seed=i),
                                  StoppingCriteria(max_new_tokens=64),
                                  grammar=GrammarSpec("json_schema", json.dumps(person))) for i in range(4)]
    got = run_all(engine, requests)
    for request in requests:
        events = got[request.request_id]
        assert events[-1].finish_reason.value == "stop", text_of(events)
        jsonschema.validate(json.loads(text_of(events)), person)
