// Decode-sized expand (a few rows per adapter), on CUDA cores:
//   v = round(sum_j partial_j)            (the split-K shrink partials, fp32 -> x's dtype)
//   y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n]
//
// Grid (column tiles over all slices, items of <= DEC_ROWS rows). A block stages its tile of B
// (r rows x COLS columns) into shared memory with cp.async, so every B byte of the launch is in
// flight at once without holding registers (a register-landed tile capped the bytes in flight
// and made wide outputs take several waves). KT threads share 8 consecutive output columns and
// split k (k = kt, kt + KT, ...), then reduce with warp shuffles.
#include "lora_common.cuh"

#define DEC_ROWS 4

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// acc = v[0:NR, k] @ B_tile[k, 8c:8c+8] over this thread's k (kt, kt + KT, ...), summed over
// the KT k-threads, then y[m, 8 columns] += scale * acc[m] (one rounding), for m < nrows <= NR.
template <int DT, int RMAX, int KT, int NR, int COLS>
__device__ __forceinline__ void accumulate_store(const u16* bsh, const float* vsh, int c, int kt, int r, int nrows,
                                                 const uint4* yv, u16* ybase, i64 y_stride, bool y_vec, int valid,
                                                 float scale) {
  float acc[NR][8];
#pragma unroll
  for (int m = 0; m < NR; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
#pragma unroll 4
  for (int k = kt; k < r; k += KT) {
    const uint4 bv = *(const uint4*)(bsh + k * COLS + 8 * c);
    float b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = to_f32<DT>(u4_get(bv, e));
#pragma unroll
    for (int m = 0; m < NR; ++m) {
      if (m < nrows) {
        const float vv = vsh[m * RMAX + k];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(vv, b[e], acc[m][e]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < NR; ++m) {
    if (m < nrows) {
#pragma unroll
      for (int e = 0; e < 8; ++e)  // fixed-order butterfly sum over the KT k-threads
#pragma unroll
        for (int o = 1; o < KT; o <<= 1) acc[m][e] += __shfl_xor_sync(0xffffffffu, acc[m][e], o);
    }
  }
  if (kt != 0 || valid <= 0) return;
#pragma unroll
  for (int m = 0; m < NR; ++m) {
    if (m < nrows) {
      u16* dst = ybase + (i64)m * y_stride;
      if (y_vec) {
        u32 out[4];
        const u32 in[4] = {yv[m].x, yv[m].y, yv[m].z, yv[m].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lo = to_f32<DT>((u16)(in[e] & 0xffffu)) + scale * acc[m][2 * e];
          const float hi = to_f32<DT>((u16)(in[e] >> 16)) + scale * acc[m][2 * e + 1];
          out[e] = (u32)from_f32<DT>(lo) | ((u32)from_f32<DT>(hi) << 16);
        }
        *(uint4*)dst = make_uint4(out[0], out[1], out[2], out[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (e < valid) dst[e] = from_f32<DT>(to_f32<DT>(dst[e]) + scale * acc[m][e]);
      }
    }
  }
}

// RMAX: the largest rank; KT: threads splitting k per group of 8 columns. A block covers
// COLS = LORA_THREADS / KT * 8 columns: its B tile is RMAX x COLS values in shared memory.
template <int DT, int RMAX, int KT>
__device__ __forceinline__ void expand_dec_body(
    const float* __restrict__ part, int ksplit, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode) {
  constexpr int COLS = LORA_THREADS / KT * 8, CHUNKS = COLS / 8;  // CHUNKS: 16-byte pieces of a B row
  __shared__ __align__(16) u16 bsh[RMAX][COLS];
  __shared__ float vsh[DEC_ROWS][RMAX];
  const int tile = blockIdx.x, item = blockIdx.y, tid = threadIdx.x, kt = tid % KT;
  int p = 0;
#pragma unroll
  for (int q = 1; q < LORA_MAX_SLICES; ++q)
    if (q < nslices && tile >= sl.tile0[q]) p = q;
  const int guess = direct_slot(mode, ntable, item);
  int r = 0;
  i64 boff = 0;
  float scale = 0.f;
  if (guess >= 0) {  // loads in flight together with the segment bounds
    r = ranks[p * nslots + guess];
    boff = b_off[p * nslots + guess];
    scale = scales[p * nslots + guess];
  }
  const LoraItem it = find_item(mode, table, ntable, rows, item, DEC_ROWS, nslots);
  if (it.slot < 0) return;
  if (it.slot != guess) {
    r = ranks[p * nslots + it.slot];
    boff = b_off[p * nslots + it.slot];
    scale = scales[p * nslots + it.slot];
  }
  if (r <= 0 || r > min(R, RMAX)) return;
  const int w = sl.width[p], n0 = (tile - sl.tile0[p]) * COLS;
  const u16* B = pool + boff + (i64)layer * r * w + n0;
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  {  // B[0:r, n0:n0+COLS] -> shared: thread tid stages piece tid % CHUNKS of rows k0, k0 + KT, ...
    const int pc = tid % CHUNKS, valid = min(8, w - n0 - 8 * pc);
    const u16* src = B + 8 * pc;
    for (int k = tid / CHUNKS; k < r; k += KT) {
      if (b_vec && valid >= 8)
        cp_async16(&bsh[k][8 * pc], src + (i64)k * w);
      else
        *(uint4*)&bsh[k][8 * pc] = load8(src + (i64)k * w, false, valid);  // zeros past the last column
    }
  }

  const int c = tid / KT, n = n0 + 8 * c, valid = min(8, w - n);
  u16* ybase = y + (i64)it.row0 * y_stride + sl.col[p] + n;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0) && valid == 8;
  uint4 yv[DEC_ROWS];
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m)
    yv[m] = (kt == 0 && y_vec && m < it.nrows) ? *(const uint4*)(ybase + (i64)m * y_stride)
                                               : make_uint4(0, 0, 0, 0);
  for (int o = tid; o < it.nrows * r; o += LORA_THREADS) {  // v, while B and y are in flight
    const int m = o / r, k = o - m * r;
    const float s = sum_partials(part, p, ksplit, rows, R, it.row0 + m, k);
    vsh[m][k] = to_f32<DT>(from_f32<DT>(s));  // v is rounded to x's dtype, as the reference
  }
  cp_async_wait_all();
  __syncthreads();

  if (it.nrows == 1)  // Distinct batches: one row per item, a quarter of the FMAs issued
    accumulate_store<DT, RMAX, KT, 1, COLS>(bsh[0], vsh[0], c, kt, r, 1, yv, ybase, y_stride, y_vec, valid, scale);
  else
    accumulate_store<DT, RMAX, KT, DEC_ROWS, COLS>(bsh[0], vsh[0], c, kt, r, it.nrows, yv, ybase, y_stride, y_vec,
                                                   valid, scale);
}

#define LORA_EXPAND_DEC_KERNEL(NAME, DT, RMAX, KT)                                            \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS, 6) NAME(                         \
      const float* part, int ksplit, int R, const u16* pool, const i64* b_off,                \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,        \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3, \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode) {                     \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};           \
    expand_dec_body<DT, RMAX, KT>(part, ksplit, R, pool, b_off, ranks, scales, table, ntable,   \
                                  nslots, rows, layer, y, y_stride, nslices, sl, mode);       \
  }

// r<N>: ranks <= N, N / 16 k-threads per 8 columns (16384 / N columns per block, a 32 KB B
// tile). Measured at the 7B decode widths: fewer k-threads (wider tiles) are faster for
// Distinct batches, where the B bytes dominate (benchmarks/RESULTS.md).
#define LORA_EXPAND_DEC_DTYPE(TAG, DT)                              \
  LORA_EXPAND_DEC_KERNEL(lora_expand_dec_##TAG##_m4_r16, DT, 16, 1)   \
  LORA_EXPAND_DEC_KERNEL(lora_expand_dec_##TAG##_m4_r32, DT, 32, 2)   \
  LORA_EXPAND_DEC_KERNEL(lora_expand_dec_##TAG##_m4_r64, DT, 64, 4)   \
  LORA_EXPAND_DEC_KERNEL(lora_expand_dec_##TAG##_m4_r128, DT, 128, 8)

LORA_EXPAND_DEC_DTYPE(bf16, 0)
LORA_EXPAND_DEC_DTYPE(fp16, 1)
