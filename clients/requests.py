"""Building API requests on the client side: Generate requests, adapter uploads, channel options."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.v1 import inference_pb2 as pb

SERVICE = "loraplex.v1.InferenceService"
DEFAULT_ADDRESS = "127.0.0.1:50051"
CHUNK_BYTES = 1024 * 1024
CHUNK_OVERHEAD = 1024  # an upload message's fields besides the data (the file name, framing), at most
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
Progress = Callable[[int, int], None]  # (bytes sent, bytes in all)

# Read-only calls are retried on UNAVAILABLE with exponential backoff (gRPC's own retry policy).
# Generate, UploadAdapter and DeleteAdapter are never retried.
RETRIED_METHODS = (
    (SERVICE, "ListAdapters"), (SERVICE, "GetAdapter"), (SERVICE, "ServerInfo"), ("grpc.health.v1.Health", "Check"),
)


def channel_options(max_message_bytes: int = 64 * 1024 * 1024, retry_attempts: int = 5) -> list[tuple[str, object]]:
    """Channel options: message size limits and the retry policy for idempotent calls."""
    if not 1 <= retry_attempts <= 5:
        raise ValueError(f"retry_attempts must be in 1..5 (gRPC's cap), got {retry_attempts}")
    policy = {
        "methodConfig": [{
            "name": [{"service": s, "method": m} for s, m in RETRIED_METHODS],
            "retryPolicy": {
                "maxAttempts": retry_attempts, "initialBackoff": "0.1s", "maxBackoff": "2s",
                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
    }
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if retry_attempts > 1:  # gRPC requires maxAttempts >= 2 in a retry policy
        options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(policy))]
    else:
        options += [("grpc.enable_retries", 0)]
    return options


def generate_request(
    prompt: str | None = None,
    *,
    adapter: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
    ignore_eos: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prompt_logprobs: int | None = None,
    n: int = 1,
    skip_special_tokens: bool | None = None,
    request_id: str = "",
    json_schema: dict | str | None = None,
    json_object: bool = False,
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; exactly one of ``prompt`` (text, tokenized with
    special tokens), ``token_ids`` or ``messages`` (chat turns, rendered with the model's template).

    Sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p``, ``min_p`` (0 = off),
    ``seed``, ``repetition_penalty``, ``presence_penalty`` and ``frequency_penalty`` ([-2, 2]),
    ``logit_bias`` ({token id: bias in [-100, 100]}, added before everything else). Output:
    ``logprobs`` / ``top_logprobs`` (0-20 alternatives) of the generated tokens, ``prompt_logprobs``
    (alternatives per prompt token, 0-20: the first event of a choice carries them), ``n`` choices
    of one prompt (1-16; each event's ``index`` says which), ``skip_special_tokens`` (default true:
    EOS and chat markers add no text). Stopping: ``max_new_tokens``, ``stop`` strings,
    ``stop_token_ids``, ``min_tokens`` (no stop before that many tokens), ``ignore_eos``.
    Structured output: ``json_schema`` (a dict or its JSON text) or ``json_object``. The server
    checks the ranges and refuses a bad value as InvalidArgumentError naming the field
    (e.g. ``sampling.min_p``); here only what would not fit the message is refused (ValueError).
    """
    given = [name for name, v in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of prompt, token_ids or messages (got {given or 'none'})")
    if isinstance(stop, str):
        stop = (stop,)
    if adapter is not None and not (isinstance(adapter, str) and adapter.strip()):
        raise ValueError(f"adapter: must be a non-empty id, got {adapter!r} (None is the base model)")
    req = pb.GenerateRequest(adapter_id=adapter or "")
    _set(req, "request_id", request_id)
    if prompt is not None:
        _set(req, "text", prompt, "prompt")
    elif token_ids is not None:
        try:
            req.token_ids.ids.extend(token_ids)
        except (TypeError, ValueError) as e:
            raise ValueError(f"token_ids: {e} (token ids are integers in 0..{2**32 - 1})") from None
    else:
        req.chat.messages.extend(_chat_message(i, m) for i, m in enumerate(messages or ()))
    if isinstance(n, int) and n < 1:  # 0 would go out as unset (proto3): one choice, not the none asked for
        raise ValueError(f"n: must be at least 1, got {n}")
    _set(req, "n", n)
    if skip_special_tokens is not None:
        _set(req, "skip_special_tokens", skip_special_tokens)
    _sampling(req.sampling, dict(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logprobs=logprobs, top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs), logit_bias)
    st = req.stopping
    if max_new_tokens is not None:
        _set(st, "max_new_tokens", max_new_tokens)
    for field, values in (("stop_strings", stop), ("stop_token_ids", stop_token_ids)):
        try:
            getattr(st, field).extend(values)
        except (TypeError, ValueError) as e:  # protobuf's TypeError names no argument
            raise ValueError(f"{'stop' if field == 'stop_strings' else field}: {e} (got {values!r})") from None
    _set(st, "min_tokens", min_tokens)
    _set(st, "ignore_eos", ignore_eos)
    if json_schema is not None and json_object:
        raise ValueError("pass json_schema or json_object, not both")
    if json_schema is not None:
        req.response_format.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        req.response_format.json_object = True
    return req


def check_one_choice(kwargs: Mapping[str, Any]) -> None:
    """``generate_text`` gathers one choice: ``n`` > 1 asked of it is ValueError at once."""
    n = kwargs.get("n", 1)
    if isinstance(n, int) and n > 1:
        raise ValueError(f"n={n}: generate_text returns one choice; use generate_choices for several")


def _sampling(s: pb.SamplingParams, values: dict[str, Any], logit_bias: Mapping[int, float] | None) -> None:
    """Set every given (not None) sampling value, and the logit bias map."""
    for name, value in values.items():
        if value is not None:
            _set(s, name, value)
    if logit_bias is None:
        return
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"logit_bias: must be a mapping of token id to bias, got {type(logit_bias).__name__}")
    for token, bias in logit_bias.items():
        # bool is an int to Python and protobuf: True as a token id is a mistake, not token 1
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**32:
            raise ValueError(f"logit_bias: keys are token ids (integers in 0..{2**32 - 1}), got {token!r}")
        try:
            s.logit_bias[token] = bias
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias[{token}]: {e} (got {bias!r})") from None


def _set(message: object, name: str, value: object, argument: str | None = None) -> None:
    """message.name = value, a protobuf range or type error naming the argument (``argument``, if
    its name is not the field's)."""
    try:
        setattr(message, name, value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{argument or name}: {e} (got {value!r})") from None


def _chat_message(i: int, m: object) -> pb.ChatMessage:
    """{"role", "content"}: content a string, or a list of OpenAI content parts ({"type", "text"}),
    sent as parts (the server takes text parts and refuses other types, naming them)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    content = m.get("content")
    if isinstance(content, str):
        return pb.ChatMessage(role=m["role"], content=content)
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
        return pb.ChatMessage(role=m["role"], parts=[pb.ContentPart(type=p["type"], text=str(p.get("text") or ""))
                                                     for p in content])
    raise ValueError(f"messages[{i}].content must be a string or a list of {{'type', 'text'}} parts, got {content!r}")


@dataclass(frozen=True, slots=True)
class UploadFile:
    name: str
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class UploadPlan:
    """The files of a PEFT adapter folder to send, with sizes and checksums."""

    adapter_id: str
    files: tuple[UploadFile, ...]
    public: bool = False  # let every tenant generate with it, show it and list it

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_folder(cls, adapter_id: str, folder: str | os.PathLike[str], public: bool = False) -> "UploadPlan":
        """Scan ``folder`` (adapter_config.json + adapter_model.safetensors); a clear error if it is
        not a PEFT LoRA folder the server can take."""
        root = check_folder(folder)
        files = [UploadFile(name, root / name, (root / name).stat().st_size, _sha256(root / name))
                 for name in ADAPTER_FILES]
        return cls(adapter_id, tuple(files), public)

    def metadata(self) -> pb.UploadAdapterRequest:
        return pb.UploadAdapterRequest(metadata=pb.UploadMetadata(
            adapter_id=self.adapter_id,
            public=self.public,
            files=[pb.UploadFile(name=f.name, size_bytes=f.size, sha256=f.sha256) for f in self.files],
        ))

    def messages(self, progress: Progress | None = None, chunk_bytes: int = CHUNK_BYTES
                 ) -> Iterator[pb.UploadAdapterRequest]:
        """Metadata, then every file in chunks; ``progress(sent, total)`` after each chunk."""
        yield self.metadata()
        sent, total = 0, self.total_bytes
        for f in self.files:
            with open(f.path, "rb") as handle:
                while data := handle.read(chunk_bytes):
                    yield pb.UploadAdapterRequest(chunk=pb.FileChunk(name=f.name, data=data))
                    sent += len(data)
                    if progress is not None:
                        progress(sent, total)
        if progress is not None and total == 0:
            progress(0, 0)


def upload_chunk_bytes(max_message_bytes: int) -> int:
    """Bytes of file in one upload message to a server that takes messages of at most
    ``max_message_bytes`` (its ServerInfo): CHUNK_BYTES, or less where that would not fit with the
    message's own fields."""
    return max(1, min(CHUNK_BYTES, max_message_bytes - CHUNK_OVERHEAD))


def check_folder(folder: str | os.PathLike[str]) -> Path:
    """``folder`` if it holds a PEFT LoRA adapter's files (adapter_config.json and
    adapter_model.safetensors), else ValueError saying what is missing. Reads no file."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{root}: not a folder")
    if not (root / ADAPTER_FILES[1]).is_file() and any((root / p).is_file() for p in PICKLE_WEIGHTS):
        raise ValueError(f"{root}: has pickle weights only; save the adapter with safe_serialization=True "
                         "(adapter_model.safetensors)")
    for name in ADAPTER_FILES:
        if not (root / name).is_file():
            raise ValueError(f"{root}: missing {name} (a PEFT LoRA folder needs {' and '.join(ADAPTER_FILES)})")
    return root


class CapturedStream:
    """An upload's request iterator that remembers what it raised (a file gone or changed, a
    progress callback that failed): gRPC reports only "Exception iterating requests!" (UNKNOWN),
    so the client re-raises this instead."""

    def __init__(self, messages: Iterator[pb.UploadAdapterRequest]) -> None:
        self._messages = messages
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[pb.UploadAdapterRequest]:
        try:
            yield from self._messages
        except BaseException as e:
            self.error = e
            raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()
