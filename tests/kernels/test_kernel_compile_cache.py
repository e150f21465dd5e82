"""The kernels a server compiles at start, and the cubins it keeps on disk for the next start
(kernels/cuda/_runtime.py, _nvrtc.py). What needs a GPU (the modules themselves) is
tests/gpu's; what decides which bytes a process loads is checked here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loraplex.kernels.cuda._nvrtc import cached_cubin
from loraplex.kernels.cuda._runtime import LORA_SOURCES

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"


def test_start_compiles_every_lora_source():
    assert set(LORA_SOURCES) == {p.name for p in CSRC.glob("lora_*.cu")}


class Compiler:
    def __init__(self, output: bytes) -> None:
        self.output, self.calls = output, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.output


def test_a_later_process_loads_the_cubin_an_earlier_one_compiled(tmp_path):
    key = ("source text", "lora_shrink.cu", "sm_90a", "-std=c++17", "nvrtc 13.0")
    first = Compiler(b"cubin v1")
    assert cached_cubin(str(tmp_path / "cache"), key, first) == b"cubin v1"
    later = Compiler(b"never asked for")
    assert cached_cubin(str(tmp_path / "cache"), key, later) == b"cubin v1"
    assert (first.calls, later.calls) == (1, 0)
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".cubin"]  # no temporary left behind


def test_any_change_in_what_the_bytes_depend_on_compiles_again(tmp_path):
    key = ("source text", "lora_shrink.cu", "sm_90a", "-std=c++17", "nvrtc 13.0")
    cached_cubin(str(tmp_path), key, Compiler(b"old"))
    for changed in (("edited source", *key[1:]), (*key[:2], "sm_100a", *key[3:]), (*key[:4], "nvrtc 13.1")):
        compiler = Compiler(b"new")
        assert cached_cubin(str(tmp_path), changed, compiler) == b"new"
        assert compiler.calls == 1
    assert len(list(tmp_path.iterdir())) == 4


def test_a_cache_that_cannot_be_written_still_serves_the_compile(tmp_path, caplog):
    blocked = tmp_path / "not a folder"
    blocked.write_text("a file where the cache folder would go")
    compiler = Compiler(b"cubin")
    with caplog.at_level(logging.WARNING):
        assert cached_cubin(str(blocked / "cache"), ("k",), compiler) == b"cubin"
        assert cached_cubin(str(blocked / "cache"), ("k",), compiler) == b"cubin"
    assert compiler.calls == 2
    assert "not written" in caplog.text and str(blocked / "cache") in caplog.text


def test_no_cache_dir_compiles_every_time(tmp_path):
    compiler = Compiler(b"cubin")
    cached_cubin(None, ("k",), compiler)
    cached_cubin(None, ("k",), compiler)
    assert compiler.calls == 2
    assert os.listdir(tmp_path) == []
