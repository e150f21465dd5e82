// Decode shrink: part[ks][row, :r] = x[row, k-range ks] @ A_slot(layer)[k-range ks, :r].
//
// Decode items hold a few rows (one, for Distinct batches), so a tensor-core shrink spends
// its issue slots staging 16-row tiles through shared memory for rows that do not exist:
// ~4300 warp-instructions a block, and it was issue-bound (6.4 us at Distinct batch 64).
// Here, on CUDA cores, each thread streams its k-rows of A straight into registers (rows
// kb + tid, kb + tid + 128, ...: a warp reads consecutive rows, contiguous bytes) and
// accumulates x[row, k] * A[k, c0:c0+16] for up to SHRINK_DEC_NR rows in fp32 registers; the
// 128 threads' sums are reduced in a fixed order (a transposing butterfly in each warp, then
// the four warps through shared memory), so results are deterministic. The rank is walked in
// chunks of 16 columns. Grid (ksplit, items, P); fp32 partials [P][ksplit][T][R], which the
// decode expand (lora_expand_dec.cu) sums. A row's partial does not depend on its item (the
// same FMA and reduction order in the one-row and the four-row code).
#pragma once
#include "lora_common.cuh"

#define SHRINK_DEC_RC 16     // rank columns per pass (the accumulators)
#define SHRINK_DEC_BATCH1 4  // one-row items: k-rows a thread has in flight together
#define SHRINK_DEC_BATCHN 2  // SHRINK_DEC_NR-row items: the same, with 4x the accumulators

// Columns [c0, c0 + 16) of A's k-row k as 16 floats (zeros past the chunk's cw columns).
template <int DT>
__device__ __forceinline__ void a_row16(float (&a)[SHRINK_DEC_RC], const uint4 (&w)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) a[8 * h + e] = to_f32<DT>(u4_get(w[h], e));
}

// One step of warp_reduce16: lanes with bit 2 * HALF set keep columns [HALF, 2 * HALF) of their
// current block of 2 * HALF columns, the others [0, HALF); each adds its partner's half.
template <int HALF>
__device__ __forceinline__ void reduce_step(float (&v)[SHRINK_DEC_RC], bool upper) {
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = upper ? v[i] : v[i + HALF];
    const float keep = upper ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * HALF);
  }
}

// Sum of v[i] over the warp's 32 lanes for the 16 columns, transposed: afterwards lane L holds
// the sum of column L >> 1 in v[0] (lanes L and L ^ 1 hold the same column). 16 shuffles.
__device__ __forceinline__ void warp_reduce16(float (&v)[SHRINK_DEC_RC]) {
  const int lane = threadIdx.x & 31;
  reduce_step<8>(v, lane & 16);
  reduce_step<4>(v, lane & 8);
  reduce_step<2>(v, lane & 4);
  reduce_step<1>(v, lane & 2);
  v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
}

// Rows [0, nr) (nr <= NR) of x (xrow, x_stride apart) times a 16-column chunk of A over the
// block's k-range, reduced and stored to the partial rows (prow, R apart). Each thread keeps
// NR x 16 accumulators, so A's k-rows are loaded once for NR rows; BATCH k-rows a thread have
// their loads in flight together. VEC: the chunk is 16 aligned columns (two 16-byte loads a
// k-row), else element loads.
template <int DT, int NR, int BATCH, bool VEC>
__device__ __forceinline__ void shrink_dec_rows(float* red, const u16* xrow, i64 x_stride, int nr, const u16* A,
                                                int r, int c0, int cw, int kb, int ke, float* prow, int R) {
  const int tid = threadIdx.x;
  const i64 step = (i64)LORA_THREADS * r;
  float acc[NR][SHRINK_DEC_RC];
#pragma unroll
  for (int m = 0; m < NR; ++m)
#pragma unroll
    for (int i = 0; i < SHRINK_DEC_RC; ++i) acc[m][i] = 0.f;
  const u16* src = A + (i64)(kb + tid) * r + c0;
  for (int k0 = kb + tid; k0 < ke; k0 += BATCH * LORA_THREADS, src += BATCH * step) {
    uint4 w[BATCH][2];
    float xv[BATCH][NR];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {  // every load of the batch issued first
      const int k = k0 + u * LORA_THREADS;
      const bool in = k < ke;
      const u16* a = src + u * step;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      w[u][0] = !in ? zero : VEC ? *(const uint4*)a : load8_slow(a, cw);
      w[u][1] = !in ? zero : VEC ? *(const uint4*)(a + 8) : cw > 8 ? load8_slow(a + 8, cw - 8) : zero;
#pragma unroll
      for (int m = 0; m < NR; ++m) xv[u][m] = in && m < nr ? to_f32<DT>(xrow[m * x_stride + k]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      float a[SHRINK_DEC_RC];
      a_row16<DT>(a, w[u]);
#pragma unroll
      for (int m = 0; m < NR; ++m)
#pragma unroll
        for (int i = 0; i < SHRINK_DEC_RC; ++i) acc[m][i] = fmaf(xv[u][m], a[i], acc[m][i]);
    }
  }
  const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int m = 0; m < NR; ++m) {
    warp_reduce16(acc[m]);
    if ((lane & 1) == 0) red[(warp * NR + m) * SHRINK_DEC_RC + (lane >> 1)] = acc[m][0];
  }
  __syncthreads();
  if (tid < NR * SHRINK_DEC_RC) {
    const int m = tid / SHRINK_DEC_RC, n = tid - m * SHRINK_DEC_RC;
    if (m < nr && n < cw) {
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < LORA_THREADS / 32; ++q) s += red[(q * NR + m) * SHRINK_DEC_RC + n];
      prow[m * R + c0 + n] = s;
    }
  }
  __syncthreads();  // red is reused by the next pass
}

template <int DT, int NR, int BATCH>
__device__ __forceinline__ void shrink_dec_chunk(float* red, const u16* xrow, i64 x_stride, int nr, const u16* A,
                                                 int r, int c0, int kb, int ke, float* prow, int R) {
  const int cw = min(SHRINK_DEC_RC, r - c0);
  if (cw == SHRINK_DEC_RC && (((u64)A) & 15) == 0 && (r & 7) == 0)  // c0 is a multiple of 16
    shrink_dec_rows<DT, NR, BATCH, true>(red, xrow, x_stride, nr, A, r, c0, cw, kb, ke, prow, R);
  else
    shrink_dec_rows<DT, NR, BATCH, false>(red, xrow, x_stride, nr, A, r, c0, cw, kb, ke, prow, R);
}

// Block (ks, item, p): the item's rows (SHRINK_DEC_NR at most: the decode items are the
// expand's: 4-row SGMV tiles, or single rows), k in [ks * kc, ks * kc + kc), all of the adapter's
// rank. One-row items (Distinct batches) take the one-row code, so their loads stay in flight
// four k-rows deep; longer items go SHRINK_DEC_NR rows a pass. red: SHRINK_DEC_RED floats.
#define SHRINK_DEC_NR 4
#define SHRINK_DEC_RED (LORA_THREADS / 32 * SHRINK_DEC_NR * SHRINK_DEC_RC)
template <int DT, bool PDL>
__device__ __forceinline__ void shrink_dec_body(int ks, int item, int p, float* red, const u16* __restrict__ x,
                                                i64 x_stride, const u16* __restrict__ pool,
                                                const i64* __restrict__ a_off, const int* __restrict__ ranks,
                                                const int* __restrict__ table, int ntable, int nslots, int rows,
                                                int h_in, int layer, int R, float* __restrict__ part, int ksplit,
                                                int kc, int mode) {
  if (PDL) pdl_launch_dependents();  // the expand's blocks may be placed now (it waits for our partials)
  ShrinkWork wk;
  if (!shrink_work(wk, p, item, SHRINK_DEC_NR, mode, table, ntable, nslots, rows, ranks, a_off, pool, layer, h_in, R))
    return;
  const LoraItem it = wk.it;
  const int r = wk.r;
  const u16* A = wk.A;
  const int kb = ks * kc, ke = min(h_in, kb + kc);
  float* prow = part + (i64)(p * ksplit + ks) * rows * R + (i64)it.row0 * R;
  const u16* xrow = x + it.row0 * x_stride;
  if (it.nrows == 1) {
    for (int c0 = 0; c0 < r; c0 += SHRINK_DEC_RC)
      shrink_dec_chunk<DT, 1, SHRINK_DEC_BATCH1>(red, xrow, x_stride, 1, A, r, c0, kb, ke, prow, R);
  } else {
    for (int c0 = 0; c0 < r; c0 += SHRINK_DEC_RC)
      shrink_dec_chunk<DT, SHRINK_DEC_NR, SHRINK_DEC_BATCHN>(red, xrow, x_stride, it.nrows, A, r, c0, kb, ke, prow,
                                                             R);
  }
}
