"""An upload's head checked as its bytes pass (adapter_store/format/upload_head.py): whatever the
chunking and the declared order, a fitting adapter passes and a misfit is refused by the same
words as the whole upload's parse, once its config and its weights' header are in and before
any of its weights' data has been fed; bad names are refused before any byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import FAKE_BASE, write_fake_adapter

from loraplex.adapter_store.assembly import DeclaredFile
from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.adapter_store.format.upload_head import UploadHead
from loraplex.inference_server.model.config import ModelConfig

OTHER_BASE = ModelConfig(model_type="llama", vocab_size=300, hidden_size=24, intermediate_size=48, num_layers=2,
                         num_heads=3, num_kv_heads=1, head_dim=8, name="other-llama")


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def _feed(head: UploadHead, files: dict[str, bytes], order: list[str], chunk: int, fed: list[int]) -> None:
    """Feed the files back to back in ``order`` in ``chunk``-byte pieces until ``head.checked``;
    ``fed`` holds the stream offset reached (the piece being fed counted)."""
    stream = b"".join(files[n] for n in order)
    for start in range(0, len(stream), chunk):
        fed[:] = [min(start + chunk, len(stream))]
        head.feed(stream[start : start + chunk])
        if head.checked:
            return


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("weights_first", [False, True])
def test_a_fitting_adapter_passes_and_a_misfit_is_refused_before_its_weights(tmp_path: Path, chunk: int,
                                                                            weights_first: bool) -> None:
    files = _files(write_fake_adapter(tmp_path / "peft"))
    order = sorted(files, reverse=weights_first)
    declared = [DeclaredFile(n, len(files[n])) for n in order]
    fits, fed = UploadHead(declared, FAKE_BASE, 64), [0]
    _feed(fits, files, order, chunk, fed)
    assert fits.checked
    with pytest.raises(AdapterValidationError) as whole:
        parse_adapter_files(files, OTHER_BASE, 64)
    misfit = UploadHead(declared, OTHER_BASE, 64)
    with pytest.raises(AdapterValidationError) as early:
        _feed(misfit, files, order, chunk, fed)
    assert str(early.value) == str(whole.value) and "shape" in str(early.value)
    if not weights_first:  # config, then the weights' header: refused by the piece that completes it
        weights = files["adapter_model.safetensors"]
        data_start = len(files["adapter_config.json"]) + 8 + int.from_bytes(weights[:8], "little")
        assert fed[0] - chunk < data_start


def test_bad_names_are_refused_at_the_metadata() -> None:
    with pytest.raises(AdapterValidationError, match="pickle files are refused"):
        UploadHead([DeclaredFile("adapter_config.json", 2), DeclaredFile("adapter_model.bin", 9)], FAKE_BASE, 64)
    with pytest.raises(AdapterValidationError, match="missing adapter_model.safetensors"):
        UploadHead([DeclaredFile("adapter_config.json", 2)], FAKE_BASE, 64)


def test_a_corrupt_header_is_refused_from_its_first_bytes(tmp_path: Path) -> None:
    files = _files(write_fake_adapter(tmp_path / "peft"))
    files["adapter_model.safetensors"] = (1 << 40).to_bytes(8, "little") + files["adapter_model.safetensors"][8:]
    order = sorted(files)
    head = UploadHead([DeclaredFile(n, len(files[n])) for n in order], FAKE_BASE, 64)
    fed = [0]
    with pytest.raises(AdapterValidationError, match="truncated or corrupt header"):
        _feed(head, files, order, 16, fed)
    assert fed[0] <= len(files["adapter_config.json"]) + 16


@pytest.mark.parametrize("change, words", [(+10, "10 trailing bytes"), (-10, "do not match its shape"),
                                           (None, "declared 0 bytes")])
def test_a_wrong_declared_size_is_named_as_one(tmp_path: Path, change: int | None, words: str) -> None:
    # the weights' header judged against a declared size that is not the file's: the refusal says that
    # the size may be what is wrong, not only the file
    files = _files(write_fake_adapter(tmp_path / "peft"))
    order = sorted(files)
    size = {n: len(files[n]) for n in order}
    size["adapter_model.safetensors"] = 0 if change is None else size["adapter_model.safetensors"] + change
    head = UploadHead([DeclaredFile(n, size[n]) for n in order], FAKE_BASE, 64)
    with pytest.raises(AdapterValidationError) as refused:
        _feed(head, files, order, 64, [0])
    assert words in str(refused.value) and "size" in str(refused.value).split(words)[1], str(refused.value)
