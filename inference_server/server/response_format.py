"""GenerateRequest.response_format -> the engine's GrammarSpec (structured output), and the
engine's refusals of a grammar's schema named as this API's field."""

from __future__ import annotations

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.engine.request import GrammarSpec
from loraplex.v1 import inference_pb2 as pb


def response_format_from_pb(msg: pb.GenerateRequest) -> GrammarSpec | None:
    """The request's grammar (structured output) from its response_format; None when unset."""
    if not msg.HasField("response_format"):
        return None
    kind = msg.response_format.WhichOneof("format")
    if kind == "json_object" and msg.response_format.json_object:
        return GrammarSpec("json_object")
    if kind == "json_schema":
        try:
            return GrammarSpec("json_schema", msg.response_format.json_schema)
        except InvalidRequestError as exc:
            raise grammar_field(exc) from None
    raise InvalidRequestError("set json_object (true) or json_schema", "response_format")


def grammar_field(exc: InvalidRequestError) -> InvalidRequestError:
    """A refusal of a grammar's schema (the engine's ``response_format.schema``) under this API's
    field, ``response_format.json_schema``; any other refusal as it is."""
    if exc.field != "response_format.schema":
        return exc
    return InvalidRequestError(str(exc).removeprefix(f"{exc.field}: "), "response_format.json_schema")
