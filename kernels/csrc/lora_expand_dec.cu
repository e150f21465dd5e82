// Decode-sized expand (a few rows per adapter), on CUDA cores:
//   v = round(sum_j partial_j)            (the split-K shrink partials, fp32 -> x's dtype)
//   y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n]
//
// Grid (column tiles of COLS = 1024 over all slices, items: <= DEC_ROWS rows of one adapter, or
// one row each from row_slot). A block stages B's rows for its columns into shared memory with
// cp.async, 16 rows at a time (a rank-16 adapter: one pass, every B byte of the launch in flight
// at once without holding registers; larger ranks walk their rows in 16-row chunks), so the grid
// depends on the shapes only, never on the engine's rank cap. KT threads share 8 consecutive
// output columns and split k (k = kt, kt + KT, ...), then reduce with warp shuffles (KT = 1 now:
// measured fastest for Distinct batches).
#include "lora_smem.cuh"

#define DEC_ROWS 4

// Stage B rows [k0, k1) of this block's columns into bsh[0 : k1 - k0] (cp.async; element-wise
// where B is misaligned, zeros past the slice's last column): thread tid stages 16-byte piece
// tid % CHUNKS of rows k0 + tid / CHUNKS, + KT, ...
template <int KT, int COLS>
__device__ __forceinline__ void stage_rows(u16* bsh, const u16* B, i64 w, int n0, bool b_vec, int k0, int k1) {
  constexpr int CHUNKS = COLS / 8;
  const int tid = threadIdx.x, pc = tid % CHUNKS, valid = min(8, (int)(w - n0 - 8 * pc));
  const u16* src = B + 8 * pc;
  for (int k = k0 + tid / CHUNKS; k < k1; k += KT) {
    u16* dst = bsh + (k - k0) * COLS + 8 * pc;
    if (b_vec && valid >= 8)
      cp_async16(smem_addr(dst), src + (i64)k * w);
    else
      *(uint4*)dst = load8(src + (i64)k * w, false, valid);
  }
}

// The first chunk, staged before anything else is live: the shared-window address converted
// once and the copy loop split from the element-wise one (~26 -> a few instructions per copy).
// The chunks after it (ranks above CR) keep stage_rows, where the accumulators hold registers.
template <int KT, int COLS>
__device__ __forceinline__ void stage_first_rows(u16* bsh, const u16* B, i64 w, int n0, bool b_vec, int k1) {
  constexpr int CHUNKS = COLS / 8;
  const int tid = threadIdx.x, pc = tid % CHUNKS, valid = min(8, (int)(w - n0 - 8 * pc));
  if (!(b_vec && valid >= 8)) return stage_rows<KT, COLS>(bsh, B, w, n0, b_vec, 0, k1);
  const u16* src = B + 8 * pc + (i64)(tid / CHUNKS) * w;
  const u32 dst = smem_addr(bsh + (tid / CHUNKS) * COLS + 8 * pc);
  for (int k = tid / CHUNKS; k < k1; k += KT, src += KT * w) cp_async16(dst + (u32)(k * COLS * sizeof(u16)), src);
}

// acc = v[0:NR, k] @ B[k, 8c:8c+8] over this thread's k (kt, kt + KT, ...), walking the rank
// in chunks of CR rows through the shared tile (the first chunk is already staged and in
// flight), summed over the KT k-threads, then y[m, 8 columns] += scale * acc[m] (one
// rounding), for m < nrows <= NR.
template <int DT, int KT, int NR, int COLS, int CR, int RV>
__device__ __forceinline__ void accumulate_store(u16* bsh, const float* vsh, const u16* B, i64 w, int n0, bool b_vec,
                                                 int c, int kt, int r, int nrows, const uint4* yv, u16* ybase,
                                                 i64 y_stride, bool y_vec, int valid, float scale) {
  float acc[NR][8];
#pragma unroll
  for (int m = 0; m < NR; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
  for (int k0 = 0; k0 < r; k0 += CR) {  // r is uniform in the block: every thread takes each turn
    if (k0 > 0) {
      __syncthreads();  // everyone is done with the previous chunk
      stage_rows<KT, COLS>(bsh, B, w, n0, b_vec, k0, min(r, k0 + CR));
    }
    cp_async_wait_all();
    __syncthreads();  // the chunk, staged by other threads (and v, on the first turn)
    const int k1 = min(r, k0 + CR);
#pragma unroll 4
    for (int k = k0 + kt; k < k1; k += KT) {
      const uint4 bv = *(const uint4*)(bsh + (k - k0) * COLS + 8 * c);
      float b[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) b[e] = to_f32<DT>(u4_get(bv, e));
#pragma unroll
      for (int m = 0; m < NR; ++m) {
        if (m < nrows) {
          const float vv = vsh[m * RV + k];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(vv, b[e], acc[m][e]);
        }
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

// KT: threads splitting k per group of 8 columns; a block covers COLS = LORA_THREADS / KT * 8
// columns and walks the rank in chunks of CR rows through one CR x COLS tile of shared memory,
// so the tile (and the grid) does not depend on the largest rank the engine accepts: rank-16
// adapters cost the same under a rank cap of 128 as under 16.
template <int DT, int KT, int CR>
__device__ __forceinline__ void expand_dec_body(
    const float* __restrict__ part, int ksplit, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode) {
  constexpr int COLS = LORA_THREADS / KT * 8;
  __shared__ __align__(16) u16 bsh[CR][COLS];
  __shared__ float vsh[DEC_ROWS][LORA_MAX_RANK];
  const int tile = blockIdx.x, item = blockIdx.y, tid = threadIdx.x, kt = tid % KT;
  ExpandWork wk;
  if (!expand_work(wk, sl, nslices, tile, item, DEC_ROWS, mode, table, ntable, rows, nslots, ranks, b_off, scales, R))
    return;
  const int p = wk.p, r = wk.r, w = wk.width, n0 = (tile - wk.tile0) * COLS;
  const float scale = wk.scale;
  const LoraItem it = wk.it;
  const u16* B = pool + wk.boff + (i64)layer * r * w + n0;
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  stage_first_rows<KT, COLS>(bsh[0], B, w, n0, b_vec, min(r, CR));  // the first chunk, in flight from here

  const int c = tid / KT, n = n0 + 8 * c, valid = min(8, w - n);
  u16* ybase = y + (i64)it.row0 * y_stride + wk.col + n;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0) && valid == 8;
  uint4 yv[DEC_ROWS];
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m)
    yv[m] = (kt == 0 && y_vec && m < it.nrows) ? *(const uint4*)(ybase + (i64)m * y_stride)
                                               : make_uint4(0, 0, 0, 0);
  pdl_wait();  // launched after the shrink as its programmatic dependent: its partials are complete from here
  for (int o = tid; o < it.nrows * r; o += LORA_THREADS) {  // v, while B and y are in flight
    const int m = o / r, k = o - m * r;
    const float s = sum_partials(part, p, ksplit, rows, R, it.row0 + m, k);
    vsh[m][k] = to_f32<DT>(from_f32<DT>(s));  // v is rounded to x's dtype, as the reference
  }
  if (it.nrows == 1)  // Distinct batches: one row per item, a quarter of the FMAs issued
    accumulate_store<DT, KT, 1, COLS, CR, LORA_MAX_RANK>(bsh[0], vsh[0], B, w, n0, b_vec, c, kt, r, 1, yv, ybase,
                                                         y_stride, y_vec, valid, scale);
  else
    accumulate_store<DT, KT, DEC_ROWS, COLS, CR, LORA_MAX_RANK>(bsh[0], vsh[0], B, w, n0, b_vec, c, kt, r, it.nrows,
                                                                yv, ybase, y_stride, y_vec, valid, scale);
}

#define LORA_EXPAND_DEC_KERNEL(NAME, DT)                                                      \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS, 6) NAME(                         \
      const float* part, int ksplit, int R, const u16* pool, const i64* b_off,                \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,        \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3, \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode) {                     \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};           \
    expand_dec_body<DT, 1, 16>(part, ksplit, R, pool, b_off, ranks, scales, table, ntable,      \
                               nslots, rows, layer, y, y_stride, nslices, sl, mode);          \
  }

// One k-thread per 8 columns (1024 columns per block), the rank in chunks of 16 rows (a 32 KB
// tile): measured at the 7B decode widths, the widest tiles are the fastest for Distinct
// batches, where the B bytes dominate (benchmarks/RESULTS.md).
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_bf16_m4, 0)
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_fp16_m4, 1)
