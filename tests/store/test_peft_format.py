"""PEFT adapter validation and the local adapter directory (atomic versions)."""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save

from loraplex.adapter_store.errors import AdapterNotFoundError, AdapterValidationError, InvalidRequestError
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.format.patterns import MATCH_BUDGET_S, PatternMatcher
from loraplex.adapter_store.format.peft_format import parse_adapter_files, parse_adapter_upload
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PREFIX = "base_model.model.model.layers"


def _files(r: int = 4, config: dict | None = None, tensors: dict | None = None) -> dict[str, bytes]:
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], **(config or {})}
    if tensors is None:
        tensors = {}
        for layer in range(2):
            tensors[f"{PREFIX}.{layer}.self_attn.q_proj.lora_A.weight"] = torch.randn(r, 32)
            tensors[f"{PREFIX}.{layer}.self_attn.q_proj.lora_B.weight"] = torch.randn(32, r)
            tensors[f"{PREFIX}.{layer}.mlp.down_proj.lora_A.weight"] = torch.randn(r, 48)
            tensors[f"{PREFIX}.{layer}.mlp.down_proj.lora_B.weight"] = torch.randn(32, r)
    return {"adapter_config.json": json.dumps(cfg).encode(), "adapter_model.safetensors": save(tensors)}


def _header_edit(edit) -> dict[str, bytes]:
    """_files() with its safetensors header (JSON) changed by ``edit(header)``, the data kept."""
    files = _files()
    data = files["adapter_model.safetensors"]
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    edit(header)
    raw = json.dumps(header).encode()
    return {**files, "adapter_model.safetensors": struct.pack("<Q", len(raw)) + raw + data[8 + n :]}


def test_a_field_this_server_does_not_know_is_refused_at_upload_unless_off() -> None:
    """A newer PEFT's field (or a typo) that is set may change the adapter's output: refused by name
    at upload; the same field written at an off default (as PEFT writes every field) is accepted.
    An adapter stored before the rule loads as it did (its patterns already judged: decided)."""
    for value in (16, True, "gelu", {"k": 1}, [3]):
        with pytest.raises(AdapterValidationError, match="not a LoRA field this server knows") as caught:
            parse_adapter_files(_files(config={"lora_new_feature": value, "qalora_group_size": 16}), CFG)
        assert caught.value.field == "lora_new_feature" and json.dumps(value) in str(caught.value)
    for off in (None, False, 0, "", {}, []):
        assert parse_adapter_files(_files(config={"lora_new_feature": off}), CFG).rank == 4
    stored = parse_adapter_files(_files(), CFG)
    assert parse_adapter_files(_files(config={"lora_new_feature": 16}), CFG, decided=stored.pattern_values).rank == 4


def test_valid_adapter_spec() -> None:
    spec = parse_adapter_files(_files(), CFG)
    assert spec.rank == 4 and spec.target_modules == ("q_proj", "down_proj") and len(spec.modules) == 4
    assert all(m.scale == 2.0 for m in spec.modules)
    rs = parse_adapter_files(_files(config={"use_rslora": True}), CFG)
    assert rs.modules[0].scale == pytest.approx(8 / 2.0)


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"adapter_config.json": b"{}"}, "missing adapter_model.safetensors"),
        ({"adapter_model.safetensors": b"x" * 16}, "missing adapter_config.json"),
        ({**_files(), "adapter_model.bin": b"pickle"}, "pickle"),
        (_files(config={"use_dora": True}), "DoRA"),
        (_files(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (_files(config={"bias": "all"}), "bias"),
        (_files(config={"target_modules": ["embed_tokens"]}), "embedding"),
        (_files(config={"peft_type": "IA3"}), "IA3"),
        (_files(config={"r": 0}), "r must be a positive integer"),
        (_files(config={"lora_alpha": 1e300}), "scale of 2.5e\\+299, past float32"),  # only NaN out
        (_files(config={"alpha_pattern": {"q_proj": -1e40}}), "past float32"),
        ({**_files(), "adapter_config.json": b"\xff\xfe"}, "not valid JSON"),
        ({**_files(), "adapter_model.safetensors": _files()["adapter_model.safetensors"][:-7]}, "truncated"),
        ({**_files(), "adapter_model.safetensors": struct.pack("<Q", 10**6) + b"{}"}, "truncated or corrupt"),
        (_files(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32)}), "lora_B weight is missing"),
        (_files(tensors={"base_model.model.lm_head.lora_A.weight": torch.randn(4, 32)}), "not a LoRA A/B weight"),
        (_files(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
                         f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 3)}), "declared rank 4"),
        (_files(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 20),
                         f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4)}), "takes 32 inputs"),
        (_files(tensors={f"{PREFIX}.7.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
                         f"{PREFIX}.7.self_attn.q_proj.lora_B.weight": torch.randn(32, 4)}), "only 2 layers"),
        (_files(r=200), "outside the supported range"),
        (_files(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32).to(torch.int32),
                         f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4)}), "dtype"),
        # fields of the wrong type: a clear error, never a crash inside validation
        (_files(config={"target_modules": 5}), "target_modules must be a string or a list of strings"),
        (_files(config={"target_modules": [1, 2]}), "target_modules must be"),
        (_files(config={"rank_pattern": [1]}), "rank_pattern must be an object"),
        (_files(config={"rank_pattern": {"q_proj": "x"}}), r"rank_pattern\['q_proj'\] must be a positive integer"),
        (_files(config={"rank_pattern": {"q_proj": True}}), "must be a positive integer"),
        (_files(config={"rank_pattern": {"(": 4}}), "key '\\(' is not a valid pattern"),
        (_files(config={"alpha_pattern": {"q_proj": "x"}}), "must be a finite number"),
        (_files(config={"alpha_pattern": {"q_proj": "nan"}}), "must be a finite number"),
        (_files(config={"alpha_pattern": {"q_proj": float("inf")}}), "must be a finite number"),
        (_files(config={"layers_to_transform": "0"}), "layers_to_transform must be a layer index"),
        ({**_files(), "adapter_config.json": b"[" * 100000 + b"]" * 100000}, "nests too deeply"),
        (_header_edit(lambda h: h[next(iter(h))].update(dtype=["F32"])), "dtype must be a string"),
        (_header_edit(lambda h: h[next(iter(h))].update(data_offsets=[0.0, 512.0])), "two integers"),
        (_header_edit(lambda h: h[next(iter(h))].update(data_offsets=["0", "512"])), "two integers"),
    ],
)
def test_bad_adapters_are_rejected_with_a_clear_message(files: dict[str, bytes], words: str) -> None:
    with pytest.raises(AdapterValidationError, match=words):
        parse_adapter_files(files, CFG)


@pytest.mark.parametrize("targets, ok", [
    (["q_proj", "down_proj"], True),
    (["self_attn.q_proj", "mlp.down_proj"], True),  # PEFT matches a name that ends with '.' + an entry
    (r"model\.layers\.\d+\.(self_attn\.q_proj|mlp\.down_proj)", True),  # a string: a full-match pattern
    ("all-linear", True),
    (["q_proj"], False),  # down_proj has weights that PEFT would leave unused
    (["proj"], False),  # an entry matches a whole name part, not a substring
    (r".*q_proj", False),
])
def test_weights_of_modules_outside_target_modules_are_refused(targets, ok: bool) -> None:
    files = _files(config={"target_modules": targets})
    if ok:
        assert {m.module for m in parse_adapter_files(files, CFG).modules} == {"q_proj", "down_proj"}
    else:
        with pytest.raises(AdapterValidationError, match="down_proj: has weights but is not among target_modules"):
            parse_adapter_files(files, CFG)


def test_a_target_modules_pattern_that_does_not_compile_is_named() -> None:
    with pytest.raises(AdapterValidationError, match="target_modules .* is not a valid pattern"):
        parse_adapter_files(_files(config={"target_modules": "(q_proj"}), CFG)


@pytest.mark.parametrize("field, value", [
    ("target_modules", r"(.|.)*X"),
    ("rank_pattern", {r"(.|.)*X": 8}),
    ("alpha_pattern", {r"(\w|\.)*X": 4}),
])
def test_patterns_that_stall_python_s_re_are_decided_at_once(field: str, value) -> None:
    """Python's re takes hours on these (holding the GIL: every request of the server would wait);
    the upload is decided in a moment: refused where the pattern leaves targeted weights out,
    else parsed (a pattern key that matches nothing leaves the default)."""
    started = time.monotonic()
    if field == "target_modules":
        with pytest.raises(AdapterValidationError, match="not among target_modules"):
            parse_adapter_files(_files(config={field: value}), CFG)
    else:
        assert parse_adapter_files(_files(config={field: value}), CFG).rank == 4
    assert time.monotonic() - started < MATCH_BUDGET_S


def test_matching_past_the_budget_is_refused_naming_the_field_and_pattern() -> None:
    matcher = PatternMatcher(budget_s=0.0)
    with pytest.raises(AdapterValidationError, match=r"rank_pattern key '\(a\)\+': matching .* used 0 s of CPU time"):
        matcher.match("(a)+", "model.layers.0.mlp.up_proj", "rank_pattern key")
    with pytest.raises(AdapterValidationError, match="target_modules '\\(' is not a valid pattern"):
        PatternMatcher().compile("(", "target_modules")


def test_rank_and_alpha_patterns_still_follow_peft_s_suffix_rule() -> None:
    spec = parse_adapter_files(_files(r=4, config={"rank_pattern": {"q_proj": 4}, "alpha_pattern": {r"layers\.1\..*": 2}}),
                               CFG)
    by = {(m.layer, m.module): m for m in spec.modules}
    assert by[(1, "q_proj")].scale == pytest.approx(2 / 4) and by[(0, "q_proj")].scale == pytest.approx(8 / 4)


@pytest.mark.parametrize("bad", ["", "../x", "a/b/c", ".hidden", "a b", "x" * 200, "t/..", "é", None, "-a",
                                 "acme/a\n", "acme\n/a", "a\n"])  # ($ would match before a final newline)
def test_bad_adapter_ids_are_rejected(bad) -> None:
    with pytest.raises(InvalidRequestError):
        validate_adapter_id(bad)


def test_the_longest_ids_the_part_rule_allows_are_valid() -> None:
    """Each part may have 64 characters, so a tenant's adapter id may have 129; a part of 65 may not."""
    assert validate_adapter_id("t" * 64 + "/" + "a" * 64) == "t" * 64 + "/" + "a" * 64
    assert validate_adapter_id("a" * 64) == "a" * 64
    for bad in ("t" * 64 + "/" + "a" * 65, "t" * 65 + "/a", "a" * 65):
        with pytest.raises(InvalidRequestError, match="1-64 characters|longer than"):
            validate_adapter_id(bad)


def test_local_directory_put_replaces_atomically_and_delete_removes(tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    first = store.put("acme/support", _files())
    second = store.put("acme/support", _files())
    assert first.version != second.version
    assert store.get("acme/support").version == second.version
    assert [i.adapter_id for i in store.list()] == ["acme/support"]
    assert len(list((tmp_path / ".versions").iterdir())) == 2, "the old version stays while a reader may hold it"
    store.delete("acme/support")
    with pytest.raises(AdapterNotFoundError):
        store.get("acme/support")
    assert store.list() == []


def test_local_directory_failed_put_leaves_nothing(tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("keep", _files())
    with pytest.raises(AdapterValidationError):
        store.put("keep", _files(config={"use_dora": True}))
    with pytest.raises(AdapterValidationError):
        store.put("new", _files(r=0))
    assert [i.adapter_id for i in store.list()] == ["keep"]
    assert not any((tmp_path / ".staging").glob("*"))


def test_a_folder_the_listing_leaves_out_is_logged_once_with_why(tmp_path: Path, caplog) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG, max_rank=4)
    for name, r in (("bad name!", 4), ("too-big", 8)):
        (tmp_path / name).mkdir()
        for file, data in _files(r=r).items():
            (tmp_path / name / file).write_bytes(data)
    with caplog.at_level(logging.WARNING):
        assert store.list() == [] and store.list() == []
    lines = [r.getMessage() for r in caplog.records if "is not listed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert any("bad name!" in line and "adapter_id" in line for line in lines)
    assert any("too-big" in line and "outside the supported range 1..4" in line for line in lines)


def test_local_directory_reads_hand_made_peft_folders(tmp_path: Path) -> None:
    folder = tmp_path / "team" / "manual"
    folder.mkdir(parents=True)
    for name, data in _files().items():
        (folder / name).write_bytes(data)
    store = LocalAdapterDirectory(tmp_path, CFG)
    assert store.get("team/manual").rank == 4


def test_local_directory_keeps_the_public_flag_with_the_version(tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    files = _files()
    assert store.put("acme/open", files, public=True).public
    assert store.get("acme/open").public and LocalAdapterDirectory(tmp_path, CFG).get("acme/open").public
    assert set(store.resolve("acme/open").files) == set(files)  # the flag is not one of the adapter's files
    assert not store.put("acme/open", files).public  # each put sets it anew
    assert not store.get("acme/open").public and [i.public for i in store.list()] == [False]
    folder = tmp_path / "team" / "manual"  # hand-made, without the flag file: private
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    assert store.get("team/manual").public is False
    (folder / "loraplex_visibility.json").write_text('{"public": "yes"}')
    with pytest.raises(AdapterValidationError, match="'team/manual': loraplex_visibility.json must be"):
        store.get("team/manual")


def test_local_directory_never_lets_a_tenant_and_an_adapter_share_a_name(tmp_path: Path) -> None:
    """An id is an adapter or a tenant folder, not both: what would remove or hide stored adapters
    (deleting a tenant as if it were an adapter, uploading an adapter over a tenant, or an
    adapter inside another one) is refused, and every stored adapter stays readable."""
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("t1/a", _files())
    store.put("t1/b", _files())
    with pytest.raises(AdapterNotFoundError):
        store.delete("t1")  # a tenant, not an adapter
    with pytest.raises(InvalidRequestError, match="tenant holding adapters"):
        store.put("t1", _files())
    store.put("solo", _files())
    with pytest.raises(InvalidRequestError, match="'solo' is an adapter"):
        store.put("solo/x", _files())
    with pytest.raises(AdapterNotFoundError):
        store.get("solo/x")
    assert [i.adapter_id for i in store.list()] == ["solo", "t1/a", "t1/b"]
    store.put("solo", _files())  # a re-upload of the adapter itself is fine
    store.delete("t1/a")
    store.delete("t1/b")
    assert store.put("t1", _files()).adapter_id == "t1"  # an emptied tenant folder may become an adapter
    assert [i.adapter_id for i in store.list()] == ["solo", "t1"]


def test_local_directory_keeps_hand_made_folders_it_cannot_replace(tmp_path: Path) -> None:
    """A hand-made folder that holds no adapter is not overwritten by an upload, and a hand-made
    adapter folder that also holds adapters is not deleted with them."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    store = LocalAdapterDirectory(tmp_path, CFG)
    with pytest.raises(InvalidRequestError, match="holds no adapter"):
        store.put("notes", _files())
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    outer = tmp_path / "team"
    inner = outer / "inner"
    inner.mkdir(parents=True)
    for name, data in _files().items():
        (outer / name).write_bytes(data)
        (inner / name).write_bytes(data)
    with pytest.raises(InvalidRequestError, match="also holds the adapters team/inner"):
        store.delete("team")
    assert store.get("team").rank == 4 and (inner / "adapter_model.safetensors").exists()


def test_local_directory_never_removes_what_a_hand_made_link_points_to(tmp_path: Path) -> None:
    """A user links a training folder into the adapter directory: a re-upload replaces the link and
    a delete removes it, and the training folder (logs, checkpoints) is left as it was."""
    training = tmp_path / "training-run"
    (training / "checkpoint-100").mkdir(parents=True)
    (training / "trainer.log").write_text("epoch 1")
    for name, data in _files().items():
        (training / name).write_bytes(data)
    root = tmp_path / "adapters"
    root.mkdir()
    (root / "linked").symlink_to(training)
    store = LocalAdapterDirectory(root, CFG)
    assert store.get("linked").rank == 4
    store.put("linked", _files(r=8))
    assert store.get("linked").rank == 8 and (training / "trainer.log").read_text() == "epoch 1"
    (root / "again").symlink_to(training)
    store.delete("again")
    assert not os.path.lexists(root / "again")
    assert sorted(p.name for p in training.iterdir()) == sorted(["checkpoint-100", "trainer.log", *_files()])


def test_local_directory_replaces_or_deletes_a_hand_made_folder_only_when_it_holds_the_peft_files_alone(
        tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    for name in ("kept", "plain"):
        (tmp_path / name).mkdir()
        for file, data in _files().items():
            (tmp_path / name / file).write_bytes(data)
    (tmp_path / "kept" / "trainer.log").write_text("mine")
    for call, what in ((lambda: store.put("kept", _files(r=8)), "replace"), (lambda: store.delete("kept"), "delete")):
        with pytest.raises(InvalidRequestError, match=f"also holds trainer.log; this server does not {what}") as e:
            call()
        assert e.value.field == "adapter_id"
    assert (tmp_path / "kept" / "trainer.log").read_text() == "mine" and store.get("kept").rank == 4
    assert store.put("plain", _files(r=8)).rank == 8  # the PEFT files alone: replaced
    store.delete("plain")
    assert [i.adapter_id for i in store.list()] == ["kept"]


def test_a_reader_that_resolved_the_old_version_reads_it_whole_after_a_re_upload(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """A re-upload swaps the link while a reader holds the old version's folder: that folder stays
    RETIRE_S, then goes with the next upload or delete."""
    from loraplex.inference_server.lora import retired_versions

    store = LocalAdapterDirectory(tmp_path, CFG)
    old = _files(r=4)
    store.put("a", old)
    pinned = Path(os.path.realpath(tmp_path / "a"))
    store.put("a", _files(r=8))
    assert {n: (pinned / n).read_bytes() for n in old} == old
    monkeypatch.setattr(retired_versions, "RETIRE_S", 0.0)
    store.put("a", _files(r=16))
    assert not pinned.exists() and len(list((tmp_path / ".versions").iterdir())) == 1


def test_rapid_re_uploads_keep_only_the_newest_replaced_versions(tmp_path: Path, monkeypatch) -> None:
    """Re-uploading one adapter in a loop does not fill the disk with its old versions for RETIRE_S:
    the newest RETIRED_PER_ADAPTER replaced ones stay (a reader may hold them), older ones go at
    once, other adapters' retired versions are not counted against it, and a listing after the
    burst removes those whose time is up."""
    from loraplex.inference_server.lora import retired_versions

    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("other", _files(r=4))
    store.put("other", _files(r=8))
    kept = retired_versions.RETIRED_PER_ADAPTER
    replaced = []
    for r in (1, 2, 3, 4, 5, 6, 7, 8):
        store.put("a", _files(r=r))
        replaced.append(Path(os.path.realpath(tmp_path / "a")))
    versions = tmp_path / ".versions"
    # linked: a, other; retired: the newest of a's replaced ones, and other's one
    assert len(list(versions.iterdir())) == 2 + kept + 1
    assert [p.exists() for p in replaced[:-1]] == [False] * (7 - kept) + [True] * kept
    assert store.get("a").rank == 8 and store.get("other").rank == 8
    monkeypatch.setattr(retired_versions, "RETIRE_S", 0.0)
    assert sorted(i.adapter_id for i in store.list()) == ["a", "other"]
    assert sorted(p.name.rpartition("@")[0] for p in versions.iterdir()) == ["a", "other"]


def test_a_start_removes_what_a_killed_process_left_and_nothing_younger(tmp_path: Path) -> None:
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("kept", _files())
    stale_stage, young_stage = tmp_path / ".staging" / "dead", tmp_path / ".staging" / "writing"
    unlinked, young_version = tmp_path / ".versions" / "x@1-dead", tmp_path / ".versions" / "x@2-new"
    for folder in (stale_stage, young_stage, unlinked, young_version):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"x" * 1000)
    hour_ago = time.time() - 3600
    for path in (stale_stage, unlinked, Path(os.path.realpath(tmp_path / "kept"))):
        os.utime(path, (hour_ago, hour_ago))
    restarted = LocalAdapterDirectory(tmp_path, CFG)
    assert not stale_stage.exists() and not unlinked.exists()
    assert young_stage.exists() and young_version.exists()  # another process's, maybe: too young to judge
    assert restarted.get("kept").rank == 4  # a linked version stays however old


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_uploads_of_non_finite_weights_are_refused_and_nothing_is_stored(tmp_path: Path, dtype, bad) -> None:
    """An adapter holding an infinity or a NaN only ever generates garbage (and its requests' caches
    fill with it): uploads refuse it, naming the tensor, and store nothing; finite values at the
    dtype's extremes pass."""
    tensors = {k: v.to(dtype) for k, v in safetensors_load(_files()["adapter_model.safetensors"]).items()}
    name = f"{PREFIX}.1.mlp.down_proj.lora_B.weight"
    extreme = dict(tensors)
    extreme[name] = tensors[name].clone()
    extreme[name][3, 1] = torch.finfo(dtype).max
    extreme[name][0, 0] = torch.finfo(dtype).tiny / 2  # a subnormal
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("ok", _files(tensors=extreme))
    poisoned = dict(tensors)
    poisoned[name] = tensors[name].clone()
    poisoned[name][5, 2] = bad
    files = _files(tensors=poisoned)
    parse_adapter_files(files, CFG)  # loads read headers only
    with pytest.raises(AdapterValidationError, match=f"tensor '{name}' holds infinite or NaN values"):
        parse_adapter_upload(files, CFG)
    with pytest.raises(AdapterValidationError, match="infinite or NaN"):
        store.put("poisoned", files)
    assert [i.adapter_id for i in store.list()] == ["ok"]


def test_local_directory_lists_without_rereading_unchanged_adapters(tmp_path: Path, monkeypatch) -> None:
    """List and Get read and hash an adapter's files once while they are unchanged (every
    ListAdapters used to re-read all of them); a re-upload, or a hand-made folder edited in
    place, is read again."""
    import os

    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("acme/a", _files())
    store.put("acme/b", _files(r=8))
    folder = tmp_path / "team" / "manual"
    folder.mkdir(parents=True)
    for name, data in _files().items():
        (folder / name).write_bytes(data)
    first = store.list()
    reads: list[str] = []
    resolve = store.resolve
    monkeypatch.setattr(store, "resolve", lambda adapter_id: reads.append(adapter_id) or resolve(adapter_id))
    assert store.list() == first and reads == []
    second = store.put("acme/b", _files(r=2))
    assert store.get("acme/b").version == second.version
    (folder / "adapter_model.safetensors").write_bytes(_files(r=16)["adapter_model.safetensors"])
    (folder / "adapter_config.json").write_bytes(_files(r=16)["adapter_config.json"])
    os.utime(folder / "adapter_config.json", ns=(1, 1))  # even with an old time the size changed
    assert {i.adapter_id: i.rank for i in store.list()} == {"acme/a": 4, "acme/b": 2, "team/manual": 16}
    assert sorted(set(reads)) == ["team/manual"]  # the new version of acme/b: its info recorded at put


def test_a_fresh_directory_lists_uploaded_adapters_without_reading_their_weights(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """A server started over a directory of uploaded adapters answers List and Get from what each
    version recorded at put (the same info a full read gives), not by reading and hashing every
    weights file; a version whose files changed size, whose record is unreadable, or that was
    checked against another base or rank cap is read and validated in full, as before."""
    first = LocalAdapterDirectory(tmp_path, CFG)
    put = {"acme/a": first.put("acme/a", _files(), public=True), "acme/b": first.put("acme/b", _files(r=8))}
    fresh = LocalAdapterDirectory(tmp_path, CFG)
    reads: list[str] = []
    resolve = fresh.resolve
    monkeypatch.setattr(fresh, "resolve", lambda adapter_id: reads.append(adapter_id) or resolve(adapter_id))
    listed = {i.adapter_id: i for i in fresh.list()}
    assert listed == put and reads == []
    full = resolve("acme/b").info  # what reading the files gives, apart from when it was made
    for field in ("version", "sha256", "rank", "lora_alpha", "target_modules", "dtype", "size_bytes", "public",
                  "pattern_values"):
        assert getattr(listed["acme/b"], field) == getattr(full, field), field

    version_a = (tmp_path / "acme" / "a").resolve()
    (version_a / "loraplex_info.json").write_text("{not json")
    version_b = (tmp_path / "acme" / "b").resolve()
    weights = version_b / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")  # an edited version: its size no longer matches
    again = LocalAdapterDirectory(tmp_path, CFG)
    reads.clear()
    resolve_again = again.resolve
    monkeypatch.setattr(again, "resolve", lambda adapter_id: reads.append(adapter_id) or resolve_again(adapter_id))
    assert again.get("acme/a").sha256 == put["acme/a"].sha256 and reads == ["acme/a"]
    with pytest.raises(AdapterValidationError):  # read in full, and the edit does not parse
        again.get("acme/b")

    capped = LocalAdapterDirectory(tmp_path, CFG, max_rank=4)  # checked under another rank cap
    capped_reads: list[str] = []
    resolve_capped = capped.resolve
    monkeypatch.setattr(capped, "resolve", lambda i: capped_reads.append(i) or resolve_capped(i))
    assert [i.adapter_id for i in capped.list()] == ["acme/a"]  # acme/b is read, and its rank 8 refused
    assert sorted(capped_reads) == ["acme/a", "acme/b"]


def test_an_adapter_that_does_not_parse_on_disk_is_refused_naming_it(tmp_path: Path) -> None:
    """A damaged weights file in the directory was refused as 'adapter_model.safetensors: truncated
    or corrupt header', naming no adapter: the caller, who only named the model, could not tell."""
    store = LocalAdapterDirectory(tmp_path, CFG)
    store.put("acme/broken", _files())
    weights = (tmp_path / "acme" / "broken").resolve() / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterValidationError, match="adapter 'acme/broken' as stored on this server cannot be "
                                                     "served: adapter_model.safetensors: truncated") as caught:
        store.resolve("acme/broken")
    assert caught.value.field is None  # nothing in the request was wrong but its name
