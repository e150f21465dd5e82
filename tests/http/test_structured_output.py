"""Structured output and tool calls end to end (#41 item 4), SmolLM2-135M-Instruct on the CPU behind
both edges, with the real openai client and the loraplex gRPC client: json_schema answers parse and
validate against their schema (jsonschema), whole and streamed, chat and completions, the openai
client's ``parse`` with a pydantic model; json_object answers are JSON objects; tools come back in
OpenAI's ``tool_calls`` shape with arguments valid for the function's parameters for "required", a
named function and "auto", streamed too, and a tool's result goes back into the conversation; a
batch mixing constrained and free requests gives the free ones the same greedy text as alone; and
what is not supported is a 400 / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from loraplex.clients import LoraplexClient
from loraplex.clients.errors import InvalidArgumentError
from loraplex.inference_server.model.checkpoint import ModelSource
from http_engine import _serve

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
}, "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Za-z_/+0-9-]{1,30}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def live(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory):
    srv, engine, url = _serve(ModelSource(path=smollm2_gguf), tmp_path_factory.mktemp("adapters"))
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
    yield srv, engine, url, client, engine.info.model_name
    client.close()
    srv.close()


def _person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}


def test_json_schema_answers_validate_whole_and_streamed(live) -> None:
    _, _, _, client, base = live
    messages = [{"role": "user", "content": "Describe a person who lives in Europe, as JSON."}]
    chat = client.chat.completions.create(model=base, messages=messages, response_format=_person_format(),
                                          temperature=0, max_tokens=120)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    streamed = client.chat.completions.create(model=base, messages=messages, response_format=_person_format(),
                                              temperature=0.8, seed=3, max_tokens=120, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    completion = client.completions.create(model=base, prompt="A person, as JSON:", max_tokens=120, temperature=0,
                                           extra_body={"response_format": _person_format()})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_the_openai_clients_parse_with_a_pydantic_model(live) -> None:
    _, _, _, client, base = live
    answer = client.chat.completions.parse(model=base, messages=[{"role": "user", "content": "Give me a city as JSON."}],
                                           response_format=City, temperature=0, max_tokens=80)
    city = answer.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_answers_are_objects(live) -> None:
    _, _, _, client, base = live
    ask = [{"role": "user", "content": "Give me a JSON object with the name and the age of a cat."}]
    for n, stream in ((2, False), (1, True)):
        out = client.chat.completions.create(model=base, messages=ask, response_format={"type": "json_object"},
                                             temperature=0, max_tokens=150, n=n, stream=stream)
        texts = (["".join(c.choices[0].delta.content or "" for c in out if c.choices)] if stream
                 else [c.message.content for c in out.choices])
        assert len(texts) == n
        for text in texts:
            assert isinstance(json.loads(text), dict)


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_calls_required_named_and_auto(live) -> None:
    _, _, _, client, base = live
    required = client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=80)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    _check_calls(required.choices[0].message.tool_calls, set(PARAMETERS))
    named = client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, temperature=0.9, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=80)
    _check_calls(named.choices[0].message.tool_calls, {"get_time"})
    for seed in range(3):  # "auto": text or calls, and calls always valid
        auto = client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, tool_choice="auto",
                                              temperature=1.0, seed=seed, max_tokens=60)
        message = auto.choices[0].message
        if message.tool_calls:
            assert auto.choices[0].finish_reason == "tool_calls"
            _check_calls(message.tool_calls, set(PARAMETERS))
        else:
            assert message.content and "<tool_call>" not in message.content


def test_streamed_tool_calls_and_a_tools_result_turn(live) -> None:
    _, _, _, client, base = live
    chunks = list(client.chat.completions.create(model=base, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=80, stream=True))
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the tag never shows as text
    _check_calls(calls, set(PARAMETERS))
    call = calls[0]
    follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=base, messages=follow, tools=TOOLS, temperature=0, max_tokens=40)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_free_requests_beside_constrained_ones_get_their_tokens_alone(live) -> None:
    _, _, url, client, base = live
    prompts = ["The capital of Italy is", "Once upon a time, in a small village,", "def fibonacci(n):"]

    def free(p: str):
        return client.completions.create(model=base, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    alone = [free(p) for p in prompts]

    async def mixed() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=300) as aclient:
            free_calls = [aclient.completions.create(model=base, prompt=p, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True}) for p in prompts]
            constrained = [aclient.chat.completions.create(
                model=base, messages=[{"role": "user", "content": f"Person {i} as JSON"}],
                response_format=_person_format(), max_tokens=100, temperature=0.5, seed=i) for i in range(3)]
            constrained.append(aclient.chat.completions.create(model=base, messages=ASK, tools=TOOLS,
                                                               tool_choice="required", max_tokens=80))
            results = await asyncio.gather(*free_calls, *constrained)
        for answer in results[len(prompts):-1]:
            jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
        _check_calls(results[-1].choices[0].message.tool_calls, set(PARAMETERS))
        return [r.choices[0].text for r in results[: len(prompts)]]
    assert asyncio.run(mixed()) == alone


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "hostname"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "not": {}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice"),  # was a 500
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": ["get_time"]}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_is_not_supported_is_refused_naming_it(live, body, param) -> None:
    _, _, _, client, base = live
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=base, messages=ASK, max_tokens=8, extra_body=body)
    assert refused.value.body["param"] == param


def test_grpc_response_format(live) -> None:
    srv, _, _, _, _ = live
    with LoraplexClient(srv.address) as client:
        messages = [{"role": "user", "content": "Describe a person, as JSON."}]
        out = client.generate_text(messages=messages, json_schema=PERSON, max_new_tokens=120)
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
        cat = [{"role": "user", "content": "Give me a JSON object with the name and the age of a cat."}]
        assert isinstance(json.loads(client.generate_text(messages=cat, json_object=True,
                                                          max_new_tokens=150).text), dict)
        for schema in ({"type": "array", "uniqueItems": True}, {"$ref": "#/$defs/missing"}):
            with pytest.raises(InvalidArgumentError) as refused:
                client.generate_text(messages=messages, json_schema=schema, max_new_tokens=8)
            assert refused.value.field == "response_format.json_schema"
        with pytest.raises(InvalidArgumentError) as refused:
            client.generate_text(messages=messages, json_object=True, ignore_eos=True, max_new_tokens=8)
        assert refused.value.field == "stopping.ignore_eos"
