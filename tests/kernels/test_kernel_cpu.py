"""The CPU SGMV backend computes exactly what the reference computes (float32 and float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_kernel_reference import _case

from loraplex import kernels
from loraplex.kernels import cpu, reference
from loraplex.kernels.operands import LoraOperands


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_backend_is_bitwise_the_reference(seed: int, dtype: torch.dtype) -> None:
    x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(seed)
    x, y, pool = x.to(dtype), y.to(dtype), pool.to(dtype)
    for layer in (0, 1):
        expect, got = y.clone(), y.clone()
        ws = torch.zeros(len(widths), x.shape[0] + 1, 128, dtype=dtype)
        reference.add_lora_slices(expect, x, LoraOperands(pool, a_off, b_off, ranks, scales, layer, widths, ws), seg)
        cpu.add_lora_slices(got, x, LoraOperands(pool, a_off, b_off, ranks, scales, layer, widths, ws), seg)
        assert torch.equal(got, expect)
        assert not torch.equal(got, y) or int(seg[-1]) == 0, "the case must add something"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the CPU backend, the reference
def test_a_seg_of_the_steps_own_segments_adds_what_the_capacity_seg_adds(dtype: torch.dtype) -> None:
    """seg may stop at the call's last segment short of the tables' capacity (what the engine's
    eager steps pass); the result is the capacity seg's. A seg past the capacity is refused."""
    for seed in range(4):
        x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(seed)
        x, y, pool = x.to(dtype), y.to(dtype), pool.to(dtype)
        ops = LoraOperands(pool, a_off, b_off, ranks, scales, 1, widths,
                           torch.zeros(len(widths), x.shape[0] + 1, 128, dtype=dtype))
        own = seg[: a_off.shape[1] - 1]  # _case's tables have two columns of empty capacity
        assert int(own[-1]) == int(seg[-1])
        full, short = y.clone(), y.clone()
        kernels.add_lora_slices(full, x, ops, seg)
        kernels.add_lora_slices(short, x, ops, own)
        assert torch.equal(short, full) and not torch.equal(full, y)
        kernels.add_lora_slices(short, x, ops, seg[:1])  # no segments: nothing to add
        assert torch.equal(short, full)
        longer = torch.cat([seg, seg[-1:]])
        with pytest.raises(ValueError, match=r"seg: shape .* S <= 8"):
            kernels.add_lora_slices(short, x, ops, longer)


def test_entry_point_takes_the_cpu_backend_for_float32_and_the_reference_for_bfloat16(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu, "add_lora_slices", lambda *a: calls.append("cpu"))
    monkeypatch.setattr(reference, "add_lora_slices", lambda *a: calls.append("reference"))
    for dtype in (torch.float32, torch.bfloat16):
        kernels.add_lora_slices(*_tiny_args(dtype))
    assert calls == ["cpu", "reference"]


def _tiny_args(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, LoraOperands, torch.Tensor]:
    """A valid one-row, one-slot add_lora_slices call: (y, x, operands, seg)."""
    table = {"dtype": torch.int64}
    ops = LoraOperands(pool=torch.zeros(64, dtype=dtype), a_off=torch.zeros(1, 1, **table),
                       b_off=torch.full((1, 1), 8, **table), ranks=torch.ones(1, 1, dtype=torch.int32),
                       scales=torch.ones(1, 1), layer=0, out_widths=(2,), workspace=torch.zeros(1, 1, 1, dtype=dtype))
    return torch.zeros(1, 2, dtype=dtype), torch.zeros(1, 4, dtype=dtype), ops, torch.tensor([0, 1], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the CPU backend, the reference
def test_bad_arguments_raise_value_errors_naming_them_on_the_cpu(dtype: torch.dtype) -> None:
    """The CPU backends check shapes, dtypes and devices as the CUDA wrapper does."""
    y, x, ops, seg = _tiny_args(dtype)
    kernels.add_lora_slices(y, x, ops, seg)  # valid as it is
    cases = [({"y": torch.zeros(1, 3, dtype=dtype)}, "y: must be"), ({"x": torch.zeros(4, dtype=dtype)}, "x: must be 2-D"),
             ({"pool": torch.zeros(64, dtype=torch.float64)}, "pool: dtype"),
             ({"a_off": torch.zeros(1, 1, dtype=torch.int32)}, "a_off"),
             ({"ranks": torch.ones(2, 1, dtype=torch.int32)}, "ranks: shape"),
             ({"seg": torch.zeros(3, dtype=torch.int32)}, "seg"), ({"layer": -1}, "layer"),
             ({"workspace": torch.zeros(1, 1, dtype=dtype)}, "workspace")]
    for change, message in cases:
        call = {"y": y, "x": x, "seg": seg} | {k: v for k, v in change.items() if k in ("y", "x", "seg")}
        bad_ops = dataclasses.replace(ops, **{k: v for k, v in change.items() if k not in ("y", "x", "seg")})
        with pytest.raises(ValueError, match=message):
            kernels.add_lora_slices(call["y"], call["x"], bad_ops, call["seg"])
    with pytest.raises(ValueError, match="row_slot: shape"):
        kernels.add_lora_slices_bgmv(y, x, ops, torch.zeros(2, dtype=torch.int32))


def _decode_case(h_in: int = 64, widths: tuple[int, ...] = (96, 32, 32), rank: int = 8, rows: int = 6, slots: int = 8,
                 layers: int = 3, seed: int = 0):
    """A decode batch: ``rows`` one-row segments, each its own adapter, all at ``rank``."""
    gen = torch.Generator().manual_seed(seed)
    per = [layers * (h_in * rank + rank * w) for w in widths]
    pool = torch.randn(slots * sum(per) + 64, generator=gen) * 0.05
    a_off = torch.zeros(len(widths), slots, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    pos = 64
    for p, w in enumerate(widths):
        for s in range(slots):
            a_off[p, s], b_off[p, s] = pos, pos + layers * h_in * rank
            pos += layers * (h_in * rank + rank * w)
    ranks = torch.full((len(widths), slots), rank, dtype=torch.int32)
    scales = torch.rand(len(widths), slots, generator=gen) + 0.5
    seg = torch.tensor(list(range(rows + 1)) + [rows] * (slots - rows), dtype=torch.int32)
    x = torch.randn(rows, h_in, generator=gen)
    y = torch.randn(rows, sum(widths), generator=gen)
    return x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers


def _batched_products_are_the_single_ones() -> bool:
    """Whether this CPU's BLAS gives a batch of 1-row products the floats of one product per row.
    It does with MKL's AVX2 kernels (the AMD EPYC CI machines); with its AVX-512 kernels (some
    Intel Xeons) the batched product sums in another order, within float32 rounding."""
    gen = torch.Generator().manual_seed(7)
    x, a = torch.randn(4, 1, 576, generator=gen), torch.randn(4, 576, 16, generator=gen)
    return torch.equal(torch.bmm(x, a), torch.stack([torch.mm(x[i], a[i]) for i in range(4)]))


BITWISE_BATCHES = _batched_products_are_the_single_ones()


def _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers) -> None:
    """The decode batch path against the reference at every layer: bit for bit where batched
    1-row products are the single ones, else within float32 rounding (a stale stack, a wrong
    adapter or a missed write is off by far more)."""
    ws = torch.zeros(len(widths), x.shape[0], 128)
    for layer in range(layers):
        expect, got = y.clone(), y.clone()
        reference.add_lora_slices(expect, x, LoraOperands(pool, a_off, b_off, ranks, scales, layer, widths, ws), seg)
        cpu.add_lora_slices(got, x, LoraOperands(pool, a_off, b_off, ranks, scales, layer, widths, ws), seg, stacks)
        if BITWISE_BATCHES:
            assert torch.equal(got, expect)
        else:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h_in,widths,rank", [(576, (576, 192, 192), 16), (1536, (576,), 8), (64, (128, 128), 64)])
def test_decode_batch_path_is_bitwise_the_reference(h_in: int, widths: tuple[int, ...], rank: int) -> None:
    """One-row segments at one rank take the batched path; the floats must not change."""
    case = _decode_case(h_in, widths, rank, rows=8, slots=10, seed=h_in + rank)
    _check_steps(None, *case)


def test_decode_stacks_are_kept_across_steps_and_stay_bitwise_the_reference() -> None:
    case = _decode_case()
    stacks = cpu.DecodeStacks()
    for _step in range(3):
        _check_steps(stacks, *case)
    rows, layers = case[0].shape[0], case[-1]
    assert stacks.copies == rows * layers, "each adapter is copied once per layer for the same batch"


def test_decode_stacks_follow_writes_to_the_pool_and_new_batches() -> None:
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case()
    rows = x.shape[0]
    stacks = cpu.DecodeStacks()
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    # an adapter reloaded into the same place (an in-place write to the pool): everything again
    pool[int(a_off[0, 2]) : int(a_off[0, 2]) + 100].mul_(3.0)
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    assert stacks.copies == 2 * rows * layers
    # the same adapters in another row order, one scale changed: nothing is copied
    a2, b2, s2 = a_off.clone(), b_off.clone(), scales.clone()
    a2[:, [4, 5]], b2[:, [4, 5]] = a_off[:, [5, 4]], b_off[:, [5, 4]]
    s2[1, 0] = 1.0
    _check_steps(stacks, x, y, pool, a2, b2, ranks, s2, seg, widths, layers)
    assert stacks.copies == 2 * rows * layers
    assert len(stacks._slots) <= stacks.max_entries


def test_a_changed_batch_copies_only_the_adapters_that_changed() -> None:
    """Requests leave and join: adapters that stay keep their slots; only newcomers are
    copied, and a smaller batch keeps its adapters in the first slots (one move per hole)."""
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case(rows=6, slots=8)
    stacks = cpu.DecodeStacks()
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    base = stacks.copies
    # row 2's request finished; the adapter of table slot 7 (never seen) joined at the end
    a2, b2 = a_off.clone(), b_off.clone()
    keep = [0, 1, 3, 4, 5, 7]
    a2[:, :6], b2[:, :6] = a_off[:, keep], b_off[:, keep]
    _check_steps(stacks, x, y, pool, a2, b2, ranks, scales, seg, widths, layers)
    assert stacks.copies - base == layers, "one adapter copied per layer"
    # two requests leave: four rows, the adapters of rows 4 and 5 move into the two freed slots
    base = stacks.copies
    seg4 = torch.tensor([0, 1, 2, 3, 4, 4, 4, 4, 4], dtype=torch.int32)
    a3, b3 = a2.clone(), b2.clone()
    a3[:, [1, 2]], b3[:, [1, 2]] = a2[:, [4, 5]], b2[:, [4, 5]]
    _check_steps(stacks, x[:4], y[:4], pool, a3, b3, ranks, scales, seg4, widths, layers)
    assert stacks.copies - base == 2 * layers
    # a batch larger than the slots: they grow, and everything is copied into the new ones
    x9, y9 = torch.randn(8, x.shape[1]), torch.randn(8, y.shape[1])
    seg8 = torch.arange(9, dtype=torch.int32)
    base = stacks.copies
    _check_steps(stacks, x9, y9, pool, a_off, b_off, ranks, scales, seg8, widths, layers)
    assert stacks.copies - base == 8 * layers


def test_decode_stacks_with_unit_scales_and_partly_adapted_slices() -> None:
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case(seed=3)
    scales[0] = 1.0  # the multiply is skipped
    ranks[1, 2] = 0  # slice 1: one row without LoRA -> the per-segment path for that slice only
    ranks[2, 4] = 4  # slice 2: mixed ranks -> per-segment path
    _check_steps(cpu.DecodeStacks(), x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)


def test_decode_stacks_with_a_pool_made_in_inference_mode() -> None:
    """Inference tensors have no write count: nothing is cached, the result is still exact."""
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case()
    with torch.inference_mode():
        pool = pool.clone()
        stacks = cpu.DecodeStacks()
        _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    assert stacks.copies == 0


def test_shrink_and_expand_stages_are_refused_without_the_cuda_kernels() -> None:
    """Splitting add_lora into its two launches exists only on the CUDA kernels; elsewhere a
    staged call is an error, never a silent half (or double) add."""
    x = torch.zeros(1, 1)
    assert not kernels.can_stage(x)
    for stage in ("shrink", "expand"):
        with pytest.raises(ValueError, match="needs the CUDA kernels"):
            kernels.add_lora_slices(x, x, LoraOperands(x, x, x, x, x, 0, (1,), x), x, stage=stage)


def test_a_lora_side_stream_is_refused_for_a_cpu_pool() -> None:
    from loraplex.inference_server.lora.batch import LoraBatchBuilder  # noqa: PLC0415
    from loraplex.inference_server.model.config import ModelConfig  # noqa: PLC0415

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=4)
    builder = LoraBatchBuilder(cfg, torch.zeros(64), max_slots=2, max_rows=4, max_rank=4)
    assert builder.static_batch().side_stream is None
    with pytest.raises(ValueError, match="side stream needs the CUDA kernels"):
        builder.static_batch(side_stream=object())


def test_an_eager_steps_workspace_rank_and_seg_follow_its_adapters() -> None:
    """An eager step's workspace R (which picks the kernels' prefill variant) follows the
    step's adapters, rounded up to 16, not the engine's rank cap; it is the same memory. Its seg
    holds its own segments (the kernels size their grids by them); graphs keep the capacity."""
    from loraplex.inference_server.lora.batch import LoraBatchBuilder  # noqa: PLC0415
    from loraplex.inference_server.lora.resident import AdapterLayout, AdapterPlacement  # noqa: PLC0415
    from loraplex.inference_server.model.config import ModelConfig  # noqa: PLC0415

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    builder = LoraBatchBuilder(cfg, torch.zeros(64), max_slots=4, max_rows=8, max_rank=128)

    def adapter(rank: int) -> AdapterPlacement:
        return AdapterPlacement.at(0, AdapterLayout((rank,) * 7, (1.0,) * 7, (0,) * 7, (0,) * 7, 0))

    for ranks, want in (((8,), 16), ((16, 4), 16), ((8, 40), 48), ((128,), 128), ((0, 17), 32)):
        batch = builder.build([(2, adapter(r)) for r in ranks])
        assert batch.workspace.shape == (3, 8, want)
        assert batch.workspace.is_contiguous() and batch.workspace.data_ptr() == builder.workspace.data_ptr()
        assert batch.seg.tolist() == [2 * i for i in range(len(ranks) + 1)]
    assert builder.static_batch().workspace.shape == (3, 8, 128)  # graphs: the cap
    assert builder.static_batch().seg.tolist() == [0, 2, 4, 4, 4]  # the last step's, to the capacity


def test_step_cache_only_for_the_cpu_backend() -> None:
    assert isinstance(kernels.step_cache(torch.zeros(4)), cpu.DecodeStacks)
    assert kernels.step_cache(torch.zeros(4, dtype=torch.bfloat16)) is None


def test_tables_rewritten_in_place_are_read_again() -> None:
    """The builder rewrites the same table buffers every step: a new step must not reuse the last read."""
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case(seed=5)
    stacks = cpu.DecodeStacks()
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    scales[0, 1] = 1.75  # same tensors, new contents
    a_off[:, [0, 1]], b_off[:, [0, 1]] = a_off[:, [1, 0]].clone(), b_off[:, [1, 0]].clone()
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    seg[3:] = 3  # fewer rows: no longer a decode batch of 6
    _check_steps(stacks, x[:3], y[:3], pool, a_off, b_off, ranks, scales, seg, widths, layers)


def test_evicted_stacks_are_not_kept_alive_by_remembered_reads() -> None:
    import gc
    import weakref

    case = list(_decode_case())
    stacks = cpu.DecodeStacks(max_entries=1)
    _check_steps(stacks, *case)
    first = weakref.ref(next(iter(stacks._slots.values())))
    case[2] = case[2].clone()  # another pool: other stacks
    _check_steps(stacks, *case)
    gc.collect()
    assert first() is None and len(stacks._slots) == 1


def test_announced_writes_make_stale_only_the_slots_they_cover() -> None:
    """An adapter loaded into a freed place, announced by the manager (note_write), is copied
    again alone; a write nobody announced makes every slot stale. Exact either way."""
    x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers = _decode_case(rows=6, slots=8)
    rows = x.shape[0]
    stacks = cpu.DecodeStacks()
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    base = stacks.copies
    # table slot 3's adapter is replaced in place by another one (new values), announced: one
    # write per slice here, since this pool keeps each slice's blocks of all adapters together
    for p, w in enumerate(widths):
        start, end = int(a_off[p, 3]), int(b_off[p, 3]) + layers * 8 * w
        before = pool._version
        pool[start:end].copy_(torch.randn(end - start) * 0.05)
        stacks.note_write(pool, start, end, before, pool._version)
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    assert stacks.copies - base == layers, "only the rewritten adapter is copied again"
    # a write that was not announced: everything again
    base = stacks.copies
    pool[int(a_off[0, 0]) : int(a_off[0, 0]) + 10].mul_(2.0)
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    assert stacks.copies - base == rows * layers
    # an announced write to another pool says nothing about this one
    base = stacks.copies
    other = pool.clone()
    before = pool._version
    pool[start:end].mul_(0.5)  # slot 3's last slice
    stacks.note_write(other, start, end, before, pool._version)
    _check_steps(stacks, x, y, pool, a_off, b_off, ranks, scales, seg, widths, layers)
    assert stacks.copies - base == rows * layers
