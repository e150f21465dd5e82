"""Random LoRA batches for the GPU kernel tests: pool, tables and a float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels import reference
from loraplex.kernels.operands import LoraOperands


@dataclass
class Batch:
    y: torch.Tensor
    x: torch.Tensor
    pool: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    table: torch.Tensor  # seg [S+1] or row_slot [T]
    layer: int
    widths: tuple[int, ...]
    workspace: torch.Tensor

    def ops(self) -> LoraOperands:
        return LoraOperands(self.pool, self.a_off, self.b_off, self.ranks, self.scales, self.layer, self.widths,
                            self.workspace)

    def args(self) -> tuple[torch.Tensor, torch.Tensor, LoraOperands, torch.Tensor]:
        """(y, x, operands, table): an add_lora_slices / add_lora_slices_bgmv call."""
        return self.y, self.x, self.ops(), self.table


def make_pool(gen, h_in, widths, ranks, layers, dtype, device, misalign):
    """Pack A/B of every (slice, slot) for `layers` layers into one pool; return pool, offsets."""
    nslices, nslots = ranks.shape
    a_off = torch.zeros(nslices, nslots, dtype=torch.int64)
    b_off = torch.zeros(nslices, nslots, dtype=torch.int64)
    chunks, pos = [], 0
    for p in range(nslices):
        for s in range(nslots):
            r = int(ranks[p, s])
            for off, size, fan in ((a_off, h_in * r, h_in), (b_off, r * widths[p], max(r, 1))):
                gap = int(torch.randint(0, 8, (1,), generator=gen)) if misalign else (-pos) % 8
                chunks.append(torch.randn(gap, generator=gen))
                pos += gap
                off[p, s] = pos
                chunks.append(torch.randn(size * layers, generator=gen) / fan**0.5)
                pos += size * layers
    pool = torch.cat(chunks + [torch.randn(8, generator=gen)]).to(dtype)
    return pool.to(device), a_off.to(device), b_off.to(device)


def make_batch(gen, *, rows, h_in, widths, ranks, table, layers=2, dtype=torch.bfloat16,
               misalign=False, x_pad=0, rank_cap=None, device="cuda"):
    """A batch with random x (optionally a row-strided view), y, scales; ranks: int [P, S]."""
    ranks = torch.as_tensor(ranks, dtype=torch.int32)
    pool, a_off, b_off = make_pool(gen, h_in, widths, ranks, layers, dtype, device, misalign)
    xfull = torch.randn(rows, h_in + x_pad, generator=gen).to(dtype).to(device)
    x = xfull[:, :h_in]
    y = (0.1 * torch.randn(rows, sum(widths), generator=gen)).to(dtype).to(device)
    scales = (0.5 + 1.5 * torch.rand(ranks.shape, generator=gen)).to(device)
    cap = rank_cap or max(1, int(ranks.max()))
    ws = torch.full((len(widths), rows + 3, cap), float("nan"), dtype=dtype, device=device)
    layer = int(torch.randint(0, layers, (1,), generator=gen))
    return Batch(y, x, pool, a_off, b_off, ranks.to(device), scales, table.to(device), layer,
                 tuple(widths), ws)


def reference64(b: Batch, bgmv: bool) -> torch.Tensor:
    """The reference on float64 CPU copies (no rounding of x @ A)."""
    cpu = [t.detach().cpu() for t in (b.y, b.x, b.pool)]
    y, x, pool = (t.double() for t in cpu)
    ws = torch.zeros(len(b.widths), x.shape[0], b.workspace.shape[2], dtype=torch.float64)
    fn = reference.add_lora_slices_bgmv if bgmv else reference.add_lora_slices
    fn(y, x, LoraOperands(pool, b.a_off.cpu(), b.b_off.cpu(), b.ranks.cpu(), b.scales.cpu(), b.layer, b.widths, ws),
       b.table.cpu())
    return y


def seg_from_lengths(lengths) -> torch.Tensor:
    seg = [0]
    for n in lengths:
        seg.append(seg[-1] + int(n))
    return torch.tensor(seg, dtype=torch.int32)


def assert_close_rows(out: torch.Tensor, ref: torch.Tensor, y0: torch.Tensor, tol: float = 2e-2):
    """Every row: ||out - ref|| <= tol * ||ref - y0|| (+ y's own rounding); elements the
    batch leaves alone (ref == y0) must be bit-identical to y0."""
    out, y0 = out.detach().cpu().double(), y0.detach().cpu().double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten workspace or bad indexing)"
    untouched = ref == y0
    assert torch.equal(out[untouched], y0[untouched]), "elements without LoRA were modified"
    delta = (ref - y0).norm(dim=1)
    err = (out - ref).norm(dim=1)
    bound = tol * delta + 2.0**-8 * ref.norm(dim=1) + 1e-6
    bad = (err > bound).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} off: err {err[bad[:5]].tolist()} vs delta {delta[bad[:5]].tolist()}"


def random_widths(gen, nslices):
    """1-3 slice widths under 700; three are q/k/v with GQA."""
    if nslices == 3:  # q/k/v with GQA: k and v narrower than q
        kv = int(torch.randint(1, 300, (1,), generator=gen))
        return (kv * int(torch.randint(1, 5, (1,), generator=gen)), kv, kv)
    return tuple(int(torch.randint(1, 700, (1,), generator=gen)) for _ in range(nslices))


def random_ranks(gen, nslices, nslots):
    """Ranks [P, S] in 0..128: some 0 (no adapter), many small."""
    ranks = torch.randint(1, 129, (nslices, nslots), generator=gen)
    ranks[torch.rand(nslices, nslots, generator=gen) < 0.15] = 0
    small = torch.rand(nslices, nslots, generator=gen) < 0.3
    ranks[small] = torch.randint(1, 9, (int(small.sum()),), generator=gen)
    return ranks


def run_against_reference(batch, bgmv):
    """add_lora (SGMV, or BGMV where bgmv) on the batch, checked row by row against the reference."""
    y0 = batch.y.clone()
    ref = reference64(batch, bgmv)
    from loraplex.kernels import cuda as kcuda  # noqa: PLC0415

    fn = kcuda.add_lora_slices_bgmv if bgmv else kcuda.add_lora_slices
    fn(*batch.args())
    torch.cuda.synchronize()
    assert_close_rows(batch.y, ref, y0)
