"""Patterns in an adapter config are judged once, at upload, by CPU time; reading a stored adapter
answers from what was decided then (the local adapter directory, records, the matcher itself).
The store sidecar's side: tests/store/test_store_pattern_decisions.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from busy_clock import BusyClock
from safetensors.torch import save

from loraplex.adapter_store.errors import AdapterValidationError, UnavailableError
from loraplex.adapter_store.format import patterns
from loraplex.adapter_store.format.pattern_decisions import PatternValue
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.adapter_store.records import StoredRecord
from loraplex.inference_server.lora.local_directory import PATTERNS_FILE, LocalAdapterDirectory
from loraplex.inference_server.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PREFIX = "base_model.model.model.layers"
BACKTRACKS = r"(.|\w|\.)*$q"  # regex needs hours for it on a module name


def _files(config: dict) -> dict[str, bytes]:
    """r=4, lora_alpha 8, q_proj at rank 8 (rank_pattern) and alpha 2 in layer 1 (alpha_pattern)."""
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], **config}
    tensors = {}
    for layer in range(2):
        tensors[f"{PREFIX}.{layer}.self_attn.q_proj.lora_A.weight"] = torch.randn(8, 32)
        tensors[f"{PREFIX}.{layer}.self_attn.q_proj.lora_B.weight"] = torch.randn(32, 8)
        tensors[f"{PREFIX}.{layer}.mlp.down_proj.lora_A.weight"] = torch.randn(4, 48)
        tensors[f"{PREFIX}.{layer}.mlp.down_proj.lora_B.weight"] = torch.randn(32, 4)
    return {"adapter_config.json": json.dumps(cfg).encode(), "adapter_model.safetensors": save(tensors)}


PLAIN = {"rank_pattern": {"q_proj": 8}, "alpha_pattern": {r"layers\.1\.mlp\..*": 2}}


def _scales(spec) -> dict[tuple[int, str], tuple[int, float]]:
    return {(m.layer, m.module): (m.rank, m.scale) for m in spec.modules}


EXPECTED = {(0, "q_proj"): (8, 1.0), (1, "q_proj"): (8, 1.0), (0, "down_proj"): (4, 2.0), (1, "down_proj"): (4, 0.5)}


def test_a_stored_version_resolves_on_a_busy_machine_before_and_after_a_restart(tmp_path: Path, monkeypatch) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("acme/plain", _files(PLAIN))
    assert (tmp_path / "acme/plain" / PATTERNS_FILE).is_file()
    monkeypatch.setattr(patterns, "time", BusyClock())
    assert _scales(store.resolve("acme/plain").spec) == EXPECTED
    assert _scales(LocalAdapterDirectory(tmp_path, CFG).resolve("acme/plain").spec) == EXPECTED


def test_a_hand_made_folder_is_judged_by_cpu_time_on_a_busy_machine(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "by-hand"
    folder.mkdir()
    for name, data in _files(PLAIN).items():
        (folder / name).write_bytes(data)
    monkeypatch.setattr(patterns, "time", BusyClock())
    assert _scales(LocalAdapterDirectory(tmp_path, CFG).resolve("by-hand").spec) == EXPECTED


def test_a_thread_that_gets_no_cpu_is_told_to_try_again_not_that_its_pattern_backtracks(monkeypatch) -> None:
    monkeypatch.setattr(patterns, "time", BusyClock(starved=True))
    matcher = patterns.PatternMatcher(budget_s=0.05, max_wait_s=0.3)
    with pytest.raises(UnavailableError, match=r"rank_pattern key .*too busy to judge.* s of CPU time in"):
        matcher.match(BACKTRACKS, "model.layers.0.self_attn.q_proj", "rank_pattern key")


def test_a_pattern_that_backtracks_is_refused_by_the_cpu_time_it_used() -> None:
    with pytest.raises(AdapterValidationError,
                       match=f"rank_pattern key {re.escape(repr(BACKTRACKS))}: .* used 0.5 s of CPU time"):
        parse_adapter_files(_files({"rank_pattern": {BACKTRACKS: 8}}), CFG)


def test_a_stored_decision_is_read_back_and_not_judged_again(tmp_path: Path, monkeypatch) -> None:
    """Reading with the upload's decisions matches no pattern: not even a pattern that would
    now take hours (the decision file stands for the upload's)."""
    files = _files(PLAIN)
    decided = parse_adapter_files(files, CFG).pattern_values
    assert sorted((v.layer, v.module, v.rank, v.alpha) for v in decided) == [
        (0, "q_proj", 8, 8.0), (1, "down_proj", 4, 2.0), (1, "q_proj", 8, 8.0)]
    slow = json.loads(files["adapter_config.json"])
    slow["rank_pattern"] = {BACKTRACKS: 8, **slow["rank_pattern"]}
    files = {**files, "adapter_config.json": json.dumps(slow).encode()}
    assert _scales(parse_adapter_files(files, CFG, decided=decided)) == EXPECTED


def test_records_keep_the_decisions_and_read_old_records_as_undecided() -> None:
    files = _files(PLAIN)
    spec = parse_adapter_files(files, CFG)
    record = StoredRecord.build("acme/plain", files, spec, 1.0)
    again = StoredRecord.from_json(record.to_json())
    assert again == record and again.info.pattern_values == spec.pattern_values
    old = json.loads(record.to_json())
    del old["pattern_values"]
    assert StoredRecord.from_json(json.dumps(old)).info.pattern_values is None


def test_a_damaged_decision_file_is_named(tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("acme/plain", _files(PLAIN))
    (tmp_path / "acme/plain" / PATTERNS_FILE).write_text('{"pattern_values": [{"layer": 0}]}')
    with pytest.raises(AdapterValidationError, match=f"{PATTERNS_FILE} must be"):
        store.resolve("acme/plain")
    shutil.rmtree(tmp_path / ".versions")


def test_a_pattern_value_needs_a_positive_rank() -> None:
    with pytest.raises(ValueError, match="layers.0.q_proj: rank must be a positive integer"):
        PatternValue(0, "q_proj", 0, 1.0)
