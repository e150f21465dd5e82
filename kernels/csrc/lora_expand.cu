// Prefill SGMV / BGMV expand: y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n],
// B_slot: [r, w_p], for every slice p of a fused output (q/k/v, gate/up) in one launch.
//
// Grid (column tiles of BN over all slices, items of BM = 128 rows). A block first puts
// its y tile in flight into shared memory (cp.async: the read-modify-write of y is what bounds
// the kernel, so those bytes go out before anything else), then walks the rank in chunks of
// EXPAND_KC rows, two deep: v[item rows, chunk] (the workspace, already rounded to the input
// dtype) and B[chunk, tile] land in shared memory while the tensor cores (ldmatrix fragments,
// mma.sync m16n8k16, fp32 accumulate; 2 x 2 warps of BM / 2 rows x BN / 2 columns) work on the chunk
// before. Then each thread adds scale * its accumulators into the y tile in shared memory (one
// rounding), and the tile goes back to y with 16-byte stores.
#include "lora_cluster.cuh"
#include "lora_smem.cuh"

#define EXPAND_BM 128  // rows per item (PREFILL_BM in kernels/cuda/_launch.py)
#define EXPAND_KC 32   // rank rows per chunk
#define EXPAND_LDV (EXPAND_KC + 8)

// BN: columns per block (EXPAND_BN in kernels/cuda/_launch.py); each of the 2 x 2 warps does
// EXPAND_BM / 2 rows (MT m16 tiles) x BN / 2 columns. Row strides of 8 elements past the tiles'
// widths: conflict-free ldmatrix. In dynamic shared memory (its size mirrored in
// kernels/cuda/_tiles.py; the kernel traps if it was given less).
template <int BN>
struct ExpandTiles {
  static constexpr int LDY = BN + 8, LDB = BN + 8, NT = BN / 16, MT = EXPAND_BM / 32;
  u16 y[EXPAND_BM * LDY];
  u16 v[2][EXPAND_BM * EXPAND_LDV];
  u16 b[2][EXPAND_KC * LDB];
};

// v[item rows, k0 : k0 + KC] and B[k0 : k0 + KC, n0 : n0 + BN] into chunk buffer `buf`; zeros past
// the item's rows, the rank and the slice's columns (the padding then adds nothing).
template <int BN>
__device__ __forceinline__ void load_chunk(ExpandTiles<BN>& t, int buf, const u16* vsrc, int R, bool v_vec,
                                           const u16* B, i64 w, int n0, bool b_vec, int r, int k0, int nrows) {
  const int tid = threadIdx.x;
  constexpr int VPR = EXPAND_KC / 8, BPR = BN / 8;
#pragma unroll
  for (int u = 0; u < EXPAND_BM * VPR / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, m = pc / VPR, k = (pc - m * VPR) * 8;
    const int valid = m < nrows ? min(8, r - k0 - k) : 0;
    tile_piece(&t.v[buf][m * EXPAND_LDV + k], vsrc + (i64)m * R + k0 + k, vsrc, v_vec, valid);
  }
#pragma unroll
  for (int u = 0; u < EXPAND_KC * BPR / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, kr = pc / BPR, n = (pc - kr * BPR) * 8;
    const int valid = k0 + kr < r ? min(8, (int)(w - n0 - n)) : 0;
    tile_piece(&t.b[buf][kr * t.LDB + n], B + (i64)(k0 + kr) * w + n0 + n, B, b_vec, valid);
  }
}

// acc[i][j] += v rows [wm*BM/2 + 16i, +16) @ B columns [wn*BN/2 + 8j, +8) over the chunk's k16 steps.
template <int DT, int BN>
__device__ __forceinline__ void mma_chunk(float (&acc)[EXPAND_BM / 32][BN / 16][4], const ExpandTiles<BN>& t,
                                          int buf, int ksteps, int wm, int wn, int nrows, int ncols) {
  constexpr int MT = EXPAND_BM / 32, WR = EXPAND_BM / 2;
  for (int ks = 0; ks < ksteps; ++ks) {
    u32 a[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
      if (wm * WR + i * 16 < nrows) ldsm_a(a[i], t.v[buf], EXPAND_LDV, wm * WR + i * 16, ks * 16);
#pragma unroll
    for (int jp = 0; jp < BN / 32; ++jp) {
      if (wn * (BN / 2) + jp * 16 >= ncols) continue;  // warp-uniform: past the slice's last column
      u32 b[4];
      ldsm_b2(b, t.b[buf], t.LDB, ks * 16, wn * (BN / 2) + jp * 16);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        if (wm * WR + i * 16 < nrows) {
          mma16816<DT>(acc[i][2 * jp], a[i], b);
          mma16816<DT>(acc[i][2 * jp + 1], a[i], b + 2);
        }
      }
    }
  }
}

// y tile += scale * acc, in shared memory: each element belongs to one thread.
template <int DT, int BN>
__device__ __forceinline__ void add_into_tile(ExpandTiles<BN>& t, const float (&acc)[EXPAND_BM / 32][BN / 16][4],
                                              float scale, int wm, int wn) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < EXPAND_BM / 32; ++i)
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32* cell = (u32*)&t.y[(wm * (EXPAND_BM / 2) + i * 16 + g + 8 * h) * t.LDY + wn * (BN / 2) + j * 8 + 2 * q];
        const u32 in = *cell;
        const float lo = to_f32<DT>((u16)(in & 0xffffu)) + scale * acc[i][j][2 * h];
        const float hi = to_f32<DT>((u16)(in >> 16)) + scale * acc[i][j][2 * h + 1];
        *cell = (u32)from_f32<DT>(lo) | ((u32)from_f32<DT>(hi) << 16);
      }
}

template <int DT, int BN>
__device__ __forceinline__ void expand_body(
    const u16* __restrict__ ws, i64 ws_pstride, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode) {
  extern __shared__ __align__(16) u16 dsmem[];
  if (dynamic_smem_bytes() < (u32)sizeof(ExpandTiles<BN>)) launch_error();  // kernels/cuda/_tiles.py is stale
  ExpandTiles<BN>& t = *reinterpret_cast<ExpandTiles<BN>*>(dsmem);
  const int tile = blockIdx.x, item = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  ExpandWork wk;
  if (!expand_work(wk, sl, nslices, tile, item, EXPAND_BM, mode, table, ntable, rows, nslots, ranks, b_off, scales,
                   R))
    return;
  const int r = wk.r, w = wk.width, n0 = (tile - wk.tile0) * BN, nrows = wk.it.nrows;
  const int ncols = min(BN, w - n0);
  constexpr int YPR = BN / 8;

  // The y tile first: the bytes that bound the kernel are in flight from here.
  u16* ybase = y + (i64)wk.it.row0 * y_stride + wk.col + n0;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0);
#pragma unroll
  for (int u = 0; u < EXPAND_BM * YPR / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, m = pc / YPR, n = (pc - m * YPR) * 8;
    tile_piece(&t.y[m * t.LDY + n], ybase + (i64)m * y_stride + n, ybase, y_vec,
               m < nrows ? min(8, ncols - n) : 0);
  }
  const u16* vsrc = ws + (i64)wk.p * ws_pstride + (i64)wk.it.row0 * R;
  const bool v_vec = ((((u64)vsrc) & 15) == 0) && ((R & 7) == 0);
  const u16* B = pool + wk.boff + (i64)layer * r * w;
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  load_chunk(t, 0, vsrc, R, v_vec, B, w, n0, b_vec, r, 0, nrows);
  cp_async_commit();

  float acc[EXPAND_BM / 32][BN / 16][4];
#pragma unroll
  for (int i = 0; i < EXPAND_BM / 32; ++i)
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  const int nchunks = (r + EXPAND_KC - 1) / EXPAND_KC;
  for (int c = 0; c < nchunks; ++c) {
    if (c + 1 < nchunks)  // chunk c + 1 into the other buffer (free: the barrier after chunk c - 1)
      load_chunk(t, (c + 1) & 1, vsrc, R, v_vec, B, w, n0, b_vec, r, (c + 1) * EXPAND_KC, nrows);
    cp_async_commit();
    cp_async_wait<1>();  // chunk c (and the y tile) have landed, this thread's copies ...
    __syncthreads();     // ... and everyone's
    const int ksteps = (min(EXPAND_KC, r - c * EXPAND_KC) + 15) >> 4;
    mma_chunk<DT, BN>(acc, t, c & 1, ksteps, wm, wn, nrows, ncols);
    __syncthreads();  // chunk c's buffer is free
  }
  cp_async_wait<0>();
  __syncthreads();
  add_into_tile<DT, BN>(t, acc, wk.scale, wm, wn);
  __syncthreads();

  // The tile back to y: 16-byte stores where aligned and whole, elements at the slice's edge.
#pragma unroll
  for (int u = 0; u < EXPAND_BM * YPR / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, m = pc / YPR, n = (pc - m * YPR) * 8, valid = min(8, ncols - n);
    if (m >= nrows || valid <= 0) continue;
    u16* dst = ybase + (i64)m * y_stride + n;
    const u16* src = &t.y[m * t.LDY + n];
    if (y_vec && valid == 8) {
      *(uint4*)dst = *(const uint4*)src;
    } else {
      for (int e = 0; e < valid; ++e) dst[e] = src[e];
    }
  }
}

#define LORA_EXPAND_KERNEL(NAME, DT, BN, MINB)                                                \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS, MINB) NAME(                      \
      const u16* ws, i64 ws_pstride, int R, const u16* pool, const i64* b_off,                \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,        \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3, \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode) {                     \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};           \
    expand_body<DT, BN>(ws, ws_pstride, R, pool, b_off, ranks, scales, table, ntable, nslots, \
                        rows, layer, y, y_stride, nslices, sl, mode);                         \
  }

// Prefill: 128-row items; 128 columns at 2 blocks a multiprocessor or 64 at 4 (launched preferring
// shared memory over L1: EXPAND_CARVEOUT in kernels/cuda/_launch.py). (The decode path's expand
// is lora_expand_dec.cu.)
LORA_EXPAND_KERNEL(lora_expand_bf16_m128_n128, 0, 128, 2)
LORA_EXPAND_KERNEL(lora_expand_fp16_m128_n128, 1, 128, 2)
LORA_EXPAND_KERNEL(lora_expand_bf16_m128_n64, 0, 64, 4)
LORA_EXPAND_KERNEL(lora_expand_fp16_m128_n64, 1, 64, 4)
