"""The tokenizer the engine and the edge use: a thin wrapper over a transformers fast tokenizer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.inference_server.model import text_bound

# Tokens that end an assistant turn in common chat templates. When the model's chat template
# closes turns with one of them, generation must stop there too (Qwen2/ChatML-style models
# whose eos is <|endoftext|>); for SmolLM2 the eos already is <|im_end|>.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True)
class ChatOptions:
    """How the chat template renders a conversation beyond its messages and tools (vLLM's chat
    parameters of the same names): the assistant turn's header at the end, or the last (assistant)
    message left open for the model to continue, and the template's own variables
    (``enable_thinking`` for Qwen3's)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


class Tokenizer:
    """Encode/decode text and render chat prompts for one base model.

    ``eos_token_ids`` holds every id that ends generation: the tokenizer's eos, the ids the
    model config / generation config name, and the end-of-turn token the chat template uses.
    """

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = ()) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError(f"tokenizer {type(hf_tokenizer).__name__} is not a fast (Rust) tokenizer")
        self._tok = hf_tokenizer
        self.eos_token_ids: tuple[int, ...] = self._collect_eos(extra_eos_ids)
        self._spell = _piece_speller(hf_tokenizer.backend_tokenizer.decoder)
        self._added_texts = {i: t.content for i, t in hf_tokenizer.added_tokens_decoder.items()}
        self._bytes_of: dict[int, bytes] = {}  # token_bytes' answers, by id

    # construction ------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load the tokenizer files of a Hugging Face model folder (tokenizer.json & co)."""
        from transformers import AutoTokenizer

        folder = os.fspath(folder)
        if not any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json) in the folder")
        try:
            tok = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # transformers raises many types for unreadable files
            raise ValueError(f"{folder}: cannot load the tokenizer: {exc}") from exc
        return cls(tok, tuple(extra_eos_ids) + _generation_config_eos(folder))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        """Build the tokenizer from a GGUF file's metadata (vocab, merges, chat template)."""
        from transformers import AutoTokenizer

        path = os.fspath(path)
        try:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        except Exception as exc:
            raise ValueError(f"{path}: cannot build a tokenizer from the GGUF metadata: {exc}") from exc
        return cls(tok, extra_eos_ids)

    def _collect_eos(self, extra: Iterable[int]) -> tuple[int, ...]:
        ids: list[int] = []
        candidates = [self._tok.eos_token_id, *extra]
        template = self._tok.chat_template if isinstance(self._tok.chat_template, str) else ""
        for token in _END_OF_TURN_TOKENS:
            if template and token in template:
                candidates.append(self._tok.convert_tokens_to_ids(token))
        for i in candidates:
            if i is not None and i != self._tok.unk_token_id and i not in ids:
                ids.append(int(i))
        return tuple(ids)

    # properties --------------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (for tests and peers)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included."""
        return len(self._tok)

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos (``eos_token_ids`` is the full stop set)."""
        return self._tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    # operations --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (``add_special_tokens`` adds bos/eos as the tokenizer defines)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def max_chars_for(self, max_tokens: int) -> int | None:
        """The most characters a text of fewer than ``max_tokens`` tokens can have (None: this
        tokenizer's pipeline bounds nothing; see text_bound.py). A longer text is past the window
        without being tokenized."""
        return text_bound.max_chars_for(self._tok.backend_tokenizer, self._tok.get_vocab(), max_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Token ids -> token strings (byte-level pieces, e.g. 'Ġhello')."""
        return list(self._tok.convert_ids_to_tokens(list(ids)))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to a text, a part of a multi-byte character included
        (where ``decode([token_id])`` gives U+FFFD): a byte-level BPE piece's bytes (GPT-2's
        byte-to-character table inverted: SmolLM2, Llama 3, Qwen), a SentencePiece piece's with
        byte fallback (``<0xF0>``, and U+2581 as a space: Gemma, Llama 2), an added token's text;
        any other token's decoded text. Cached per id."""
        found = self._bytes_of.get(token_id)
        if found is None:
            found = self._bytes_of[token_id] = self._uncached_bytes(token_id)
        return found

    def _uncached_bytes(self, token_id: int) -> bytes:
        added = self._added_texts.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tok.convert_ids_to_tokens(token_id)
        found = self._spell(piece) if self._spell is not None and isinstance(piece, str) else None
        return found if found is not None else self.decode([token_id]).encode()

    @property
    def chat_template(self) -> str:
        """The chat template's Jinja text ("" without one)."""
        return self._tok.chat_template if isinstance(self._tok.chat_template, str) else ""

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatOptions = ChatOptions()) -> str:
        """The chat template applied to ``messages`` (and ``tools``, OpenAI's function tools, for a
        template that renders them), with the assistant generation prompt unless ``options`` say
        otherwise. A template that refuses the messages (``raise_exception``, an undefined variable)
        is a ValueError saying why."""
        import jinja2  # noqa: PLC0415  (transformers' template engine)

        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a raw prompt instead")
        _check_messages(messages)
        try:
            return self._tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **options.template_kwargs)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            options: ChatOptions = ChatOptions()) -> list[int]:
        """Chat messages -> prompt token ids, ending with the assistant generation prompt.

        Same ids as transformers' ``apply_chat_template(..., tools=tools, add_generation_prompt=True)``
        (and its other arguments from ``options``): the template text is tokenized without adding
        special tokens again.
        """
        return self.encode(self.render_chat(messages, tools, options), add_special_tokens=False)


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode``: each byte as the printable character byte-level pieces spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_OF_CHAR = {char: byte for byte, char in _gpt2_byte_chars().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_bytes(piece: str) -> bytes | None:
    """'ĠðŁ' -> b' \\xf0\\x9f' (None: a character outside GPT-2's table)."""
    try:
        return bytes(_BYTE_OF_CHAR[char] for char in piece)
    except KeyError:
        return None


def _sentencepiece_bytes(piece: str) -> bytes:
    """'<0xF0>' -> b'\\xf0'; '▁hi' -> b' hi'."""
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()


# a tokenizer.json decoder's type -> how its pieces spell bytes
_PIECE_BYTES: dict[str, Callable[[str], bytes | None]] = {
    "ByteLevel": _byte_level_bytes, "ByteFallback": _sentencepiece_bytes, "Metaspace": _sentencepiece_bytes,
}


def _piece_speller(decoder: Any) -> Callable[[str], bytes | None] | None:
    """How the pieces of a tokenizer whose decoder is ``decoder`` (a ``tokenizers`` decoder) spell
    bytes, by the decoder's type (None: not known). Its JSON is read as pickling writes it: the
    whole tokenizer's ``to_str()`` costs a second on a 262k-token vocabulary."""
    kinds = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else []
    return next((_PIECE_BYTES[kind] for kind in kinds if kind in _PIECE_BYTES), None)


def _decoder_types(decoder: dict[str, Any]) -> list[str]:
    """The types of a tokenizer.json decoder and of those a ``Sequence`` holds, in order."""
    return [decoder["type"], *(t for d in decoder.get("decoders") or () for t in _decoder_types(d))]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"chat message {i} must be a dict with 'role' (str) and 'content'")


def _generation_config_eos(folder: str) -> tuple[int, ...]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable generation config: {exc}") from exc
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
