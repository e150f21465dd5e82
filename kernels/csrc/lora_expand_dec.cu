// Decode-sized expand (a few rows per adapter), on CUDA cores:
//   v = round(sum_j partial_j)            (the split-K shrink partials, fp32 -> x's dtype)
//   y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n]
//
// Grid (column tiles over all slices, items of <= 4 rows). KT threads share 8 consecutive
// output columns and split k (k = kt, kt+KT, ...), then reduce with warp shuffles. Each thread issues its B loads (and y loads) before summing v, so a block
// costs about one memory round trip for r <= 16.
#include "lora_common.cuh"

#define DEC_ROWS 4
// KT: threads splitting k per group of 8 columns (a block covers LORA_THREADS / KT * 8
// columns); KU: k rows per thread and round (16-byte B loads in flight per thread).

template <int DT, int KT, int KU>
__device__ __forceinline__ void expand_dec_body(
    const float* __restrict__ part, int ksplit, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode) {
  __shared__ float vsh[DEC_ROWS][LORA_MAX_RANK];
  const int tile = blockIdx.x, item = blockIdx.y, tid = threadIdx.x, kt = tid & (KT - 1);
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
  if (r <= 0 || r > min(R, LORA_MAX_RANK)) return;
  const int w = sl.width[p], n = (tile - sl.tile0[p]) * (LORA_THREADS / KT * 8) + (tid / KT) * 8;
  const int valid = min(8, w - n);
  const u16* B = pool + boff + (i64)layer * r * w + n;
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  u16* ybase = y + (i64)it.row0 * y_stride + sl.col[p] + n;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0) && valid == 8;

  uint4 yv[DEC_ROWS];
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m)
    yv[m] = (kt == 0 && y_vec && m < it.nrows) ? *(const uint4*)(ybase + (i64)m * y_stride)
                                               : make_uint4(0, 0, 0, 0);
  float acc[DEC_ROWS][8];
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[m][e] = 0.f;
  for (int k0 = 0; k0 < r; k0 += KT * KU) {
    uint4 bv[KU];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int k = k0 + kt + u * KT;
      bv[u] = (k < r && valid > 0) ? load8(B + (i64)k * w, b_vec, valid) : make_uint4(0, 0, 0, 0);
    }
    if (k0 == 0) {  // v while the first loads of B and y are in flight
      for (int o = tid; o < it.nrows * r; o += LORA_THREADS) {
        const int m = o / r, k = o - m * r;
        const float s = sum_partials(part, p, ksplit, rows, R, it.row0 + m, k);
        vsh[m][k] = to_f32<DT>(from_f32<DT>(s));  // v is rounded to x's dtype, as the reference
      }
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int k = k0 + kt + u * KT;
      if (k < r) {
        float b[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) b[e] = to_f32<DT>(u4_get(bv[u], e));
#pragma unroll
        for (int m = 0; m < DEC_ROWS; ++m) {
          if (m < it.nrows) {
            const float vv = vsh[m][k];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(vv, b[e], acc[m][e]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m) {
    if (m < it.nrows) {
#pragma unroll
      for (int e = 0; e < 8; ++e)  // fixed-order butterfly sum over the KT k-threads
#pragma unroll
        for (int o = 1; o < KT; o <<= 1) acc[m][e] += __shfl_xor_sync(0xffffffffu, acc[m][e], o);
    }
  }
  if (kt != 0 || valid <= 0) return;
#pragma unroll
  for (int m = 0; m < DEC_ROWS; ++m) {
    if (m < it.nrows) {
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

#define LORA_EXPAND_DEC_KERNEL(NAME, DT, KT, KU)                                              \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS, 4) NAME(                         \
      const float* part, int ksplit, int R, const u16* pool, const i64* b_off,                \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,        \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3, \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode) {                     \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};           \
    expand_dec_body<DT, KT, KU>(part, ksplit, R, pool, b_off, ranks, scales, table, ntable, nslots,   \
                        rows, layer, y, y_stride, nslices, sl, mode);                         \
  }

// r32: ranks <= 32, 2 k-threads, 512 columns per block; r128: 4 k-threads, 256 columns.
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_bf16_m4_r32, 0, 2, 8)
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_bf16_m4_r128, 0, 4, 8)
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_fp16_m4_r32, 1, 2, 8)
LORA_EXPAND_DEC_KERNEL(lora_expand_dec_fp16_m4_r128, 1, 4, 8)
