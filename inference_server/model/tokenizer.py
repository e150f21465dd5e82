"""The tokenizer the engine and the edge use: a thin wrapper over a transformers fast tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from loraplex.inference_server.model import text_bound

# Tokens that end an assistant turn in common chat templates. When the model's chat template
# closes turns with one of them, generation must stop there too (Qwen2/ChatML-style models
# whose eos is <|endoftext|>); for SmolLM2 the eos already is <|im_end|>.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


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

    @property
    def chat_template(self) -> str:
        """The chat template's Jinja text ("" without one)."""
        return self._tok.chat_template if isinstance(self._tok.chat_template, str) else ""

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``, OpenAI's function tools, for a
        template that renders them), with the assistant generation prompt."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a raw prompt instead")
        _check_messages(messages)
        return self._tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
        """Chat messages -> prompt token ids, ending with the assistant generation prompt.

        Same ids as transformers' ``apply_chat_template(..., tools=tools, add_generation_prompt=True)``:
        the template text is tokenized without adding special tokens again.
        """
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


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
