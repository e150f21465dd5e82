"""Each family's chat template and end-of-turn token, from the tokenizer's own files, through both
edges: the prompt the server renders is transformers' ``apply_chat_template``, and the turn's
end token (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``, Qwen's ``<|im_end|>``) ends a
chat answer as a stop ("stop", not in the text), over HTTP (the openai client) and gRPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import openai
import pytest

from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.server.app import ServerOptions
from loraplex.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from server_helpers import ServerThread
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow

GEMMA = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] "
         "| trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
         "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, bos_token_id=1)
# family -> (transformers prefix, config, chat template, special tokens to add, the end of a turn)
FAMILIES = {
    "gemma3": ("Gemma3", dict(SIZES, head_dim=16, sliding_window=16), GEMMA, ["<start_of_turn>", "<end_of_turn>"],
               "<end_of_turn>"),
    "llama3": ("Llama", SIZES, LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "qwen3": ("Qwen3", dict(SIZES, head_dim=16), QWEN, [], "<|im_end|>"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(server, engine, HTTP url, transformers tokenizer, end-of-turn id) for a tiny model of the
    family whose tokenizer carries its chat template and turn tokens; its eos is another token."""
    import transformers

    prefix, sizes, template, tokens, turn_end = FAMILIES[request.param]
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": tokens, "eos_token": "<|endoftext|>"})
    tok.chat_template = template
    tok_dir = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(tok_dir)
    config_cls = getattr(transformers, f"{prefix}TextConfig" if prefix == "Gemma3" else f"{prefix}Config")
    config = config_cls(**sizes, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    folder = save_tiny_model(getattr(transformers, f"{prefix}ForCausalLM"), config, tok_dir,
                             tmp_path_factory.mktemp("model"), seed=3)
    srv = ServerThread(ServerOptions(port=0, default_max_new_tokens=8))
    url = srv.start_http(default_max_new_tokens=8)
    engine = build_engine(AsyncEngine, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128),
                          ModelSource(path=str(folder)), tmp_path_factory.mktemp("adapters"), progress=False)
    srv.attach(engine)
    yield srv, engine, url, tok, tok.convert_tokens_to_ids(turn_end)
    srv.close()


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_the_prompt_is_transformers_rendering_and_the_turn_end_is_a_stop(served) -> None:
    _, engine, _, tok, turn_end = served
    ours = engine.tokenizer.apply_chat_template(MESSAGES)
    theirs = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours == list(theirs)
    assert turn_end in engine.info.eos_token_ids and tok.eos_token_id in engine.info.eos_token_ids


def test_the_turn_end_ends_an_answer_on_both_edges(served) -> None:
    srv, engine, url, _, turn_end = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    base = engine.info.model_name
    # after two free tokens the turn's end is made certain: the answer must stop there, without it
    free = client.chat.completions.create(model=base, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    forced = client.chat.completions.create(model=base, messages=MESSAGES, max_tokens=8, temperature=0,
                                            logit_bias={str(turn_end): 100}, extra_body={"min_tokens": 2})
    assert forced.choices[0].finish_reason == "stop" and forced.usage.completion_tokens == 3
    assert forced.choices[0].message.content == free.choices[0].message.content
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]),
        sampling=pb.SamplingParams(temperature=0.0, logit_bias={turn_end: 100.0}),
        stopping=pb.StoppingCriteria(max_new_tokens=8, min_tokens=2))
    with grpc.insecure_channel(srv.address) as channel:
        events = list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=60))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == pb.FINISH_REASON_STOP and text == free.choices[0].message.content
    assert sum(len(e.token_ids) for e in events) == 3
