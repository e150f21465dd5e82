"""The most characters a text of fewer than n tokens can hold, for a Hugging Face fast tokenizer.

It lets the edge refuse a prompt far past the context window by its length alone, before the
tokenizer spends seconds of CPU and hundreds of MiB on megabytes of text.

Each token stands for at most L characters of the normalized text, L being the vocabulary's
longest token string (byte-level BPE spells a token one character per byte, and a text character
is at least one byte; SentencePiece's '▁' stands for one space; added tokens count by their
content). A text of N normalized characters therefore has at least N / L tokens, as long as no
step drops text or folds an unknown run into one token. Composing normalizers (NFC, NFKC) shrink
a text at most 4-fold (a canonical composition joins at most four code points). Where a step can
drop text (Strip, BertNormalizer, a whitespace-splitting pre-tokenizer, a Split that removes its
matches) or the model folds unknown text (WordPiece, unk without byte fallback), no such bound
holds and ``max_chars_for`` gives None: such prompts are only judged once tokenized.
"""

from __future__ import annotations

import json
from typing import Any

_KEEPS_LENGTH = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1}
_PRE_TOKENIZERS_KEEPING_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLIT_BEHAVIOURS_KEEPING_TEXT = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


def max_chars_for(backend: Any, vocab: dict[str, int], max_tokens: int) -> int | None:
    """The most characters a text encoded by ``backend`` (a ``tokenizers.Tokenizer``) into fewer
    than ``max_tokens`` tokens can have; None where the pipeline gives no bound."""
    shrink = chars_per_token_bound(backend, vocab)
    return None if shrink is None else max(max_tokens - 1, 0) * shrink


def chars_per_token_bound(backend: Any, vocab: dict[str, int]) -> int | None:
    """The most input characters one token can stand for (None: unbounded for this pipeline)."""
    pipeline = json.loads(backend.to_str())
    factor = _normalizer_shrink(pipeline.get("normalizer"))
    if factor is None or not _keeps_text(pipeline.get("pre_tokenizer")) or not _model_splits_unknowns(
            pipeline.get("model") or {}, pipeline.get("pre_tokenizer")):
        return None
    longest = max((len(token) for token in vocab), default=1)
    return factor * max(longest, 1)


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many input characters one normalized character can come from (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers", []):
            one = _normalizer_shrink(step)
            if one is None:
                return None
            factor *= one
        return factor
    if kind == "Replace":  # SentencePiece's ' ' -> '▁': one character for one
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        return 1 if len(pattern.get("String", "")) == 1 and content else None
    return _KEEPS_LENGTH.get(kind)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") in _SPLIT_BEHAVIOURS_KEEPING_TEXT
    return kind in _PRE_TOKENIZERS_KEEPING_TEXT


def _model_splits_unknowns(model: dict, pre: dict | None) -> bool:
    """Every input character ends up in some token of bounded length: byte-level BPE (every byte
    is in the vocabulary), byte fallback, or unknown characters that are not fused into one."""
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return False  # WordPiece folds a whole unknown word into one [UNK]
    if model.get("byte_fallback") or _is_byte_level(pre):
        return True
    return kind == "BPE" and not model.get("fuse_unk", False)


def _is_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"
