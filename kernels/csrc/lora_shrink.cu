// SGMV / BGMV shrink on tensor cores: v[rows of item, :r] = x[rows] @ A_slot(layer), A_slot: [h_in, r].
//
// Grid (ksplit, items, P): block (ks, item, p) multiplies the item's rows (bm of them at
// most) by the k-range [ks*kc, ks*kc + kc) of slice p's A on tensor cores (mma.sync,
// fp32 accumulate), in chunks of the rank. A's chunk is staged with 16-byte loads, flat ([k][r]
// as in memory) when the chunk is the whole rank. Each block stores an fp32 partial
// [P][ksplit][T][R]. Then the last block of an item
// (an atomic counter that it resets to 0, so counters are zero between launches and a
// captured graph replays) sums them in fixed order (deterministic) and writes v rounded to
// x's dtype into the workspace. With ksplit = 1 the block writes the workspace directly.
// NTM: n-tiles of 8 per rank chunk; larger ranks take several chunks (x staged again for
// each), a smaller NTM keeps registers low.
#include "lora_common.cuh"

template <int BM>
struct ShrinkShape {
  static constexpr int WM = BM / 16;           // warps along rows
  static constexpr int WK = 4 / WM;            // warps splitting k
  static constexpr int KSD_MAX = 8192 / BM;    // k depth of one stage, at most
  static constexpr int LDX = KSD_MAX + 8;      // x tile row stride (elements)
  static constexpr int XS = BM * LDX;          // x tile elements
  static constexpr int AS = 8192 + 16;         // A tile, flat [k][r]: ksd * r <= 8192, + slack
  static constexpr int LDR = LORA_MAX_RANK + 8;
  static constexpr int STAGE_BYTES = (XS + AS) * 2;
  static constexpr int RED_BYTES = WK * BM * LDR * 4;
  static constexpr int SMEM = STAGE_BYTES > RED_BYTES ? STAGE_BYTES : RED_BYTES;
};

// One rank chunk's geometry: columns [c0, c0 + cw) of A, staged as [k][ld] with 16-byte pieces:
// flat as in memory when the chunk is all of A's columns (ld = r), else row by row (ld = cw
// rounded up to 8, zeros past cw); ksd: the k depth of one stage.
struct ChunkShape {
  int cw, ld, ppr, ntiles, ksd;
  bool flat, a_vec;
};

template <int BM, int NTM>
__device__ __forceinline__ ChunkShape chunk_shape(const u16* A, int r, int c0) {
  ChunkShape c;
  c.cw = min(NTM * 8, r - c0);
  c.flat = c.cw == r;
  c.ld = c.flat ? r : (c.cw + 7) & ~7;
  c.ppr = c.ld >> 3;
  c.ntiles = (c.cw + 7) >> 3;
  c.ksd = min((8192 / ((c.ld + 15) & ~15)) & ~15, ShrinkShape<BM>::KSD_MAX);
  c.a_vec = (((u64)A) & 15) == 0 && (c.flat || ((r & 7) == 0 && (c0 & 7) == 0));
  return c;
}

// Stage k in [k0, k0 + depth) of the item's x rows into xs and of A's chunk into as. Only the
// item's rows of x are loaded: rows past nrows only feed output rows that are never stored. All
// loads of the stage are issued before any shared-memory store.
template <int BM>
__device__ __forceinline__ void stage_x_and_a(u16* xs, u16* as, const u16* x, i64 x_stride, bool x_vec,
                                              const u16* A, int r, int c0, const ChunkShape& c, int k0, int depth,
                                              const LoraItem& it) {
  typedef ShrinkShape<BM> S;
  const int tid = threadIdx.x;
  const int dpad = (depth + 15) & ~15, vpr = dpad >> 3;
  const int mstep = LORA_THREADS / vpr, m0 = tid / vpr, kk = (tid - m0 * vpr) * 8;
  const u16* xsrc = x + (i64)(it.row0 + m0) * x_stride + k0 + kk;
  const int ne = depth * r, ntot = dpad * c.ld;
  const bool xt = tid < mstep * vpr;  // threads past mstep*vpr load no x
  uint4 xv[8], av[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {  // rows m0 + u*mstep: 8 steps cover BM (mstep >= BM/8)
    xv[u] = (xt && m0 + u * mstep < it.nrows) ? load8(xsrc + (i64)u * mstep * x_stride, x_vec, depth - kk)
                                              : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) {  // piece pc lands at as + 8 * pc: row pc / ppr, columns 8 * (pc % ppr)
    const int pc = tid + u * LORA_THREADS, e0 = pc * 8;
    if (e0 >= ntot) {
      av[u] = make_uint4(0, 0, 0, 0);
    } else if (c.flat) {
      av[u] = load8(A + (i64)k0 * r + e0, c.a_vec, ne - e0);
    } else {
      const int k = pc / c.ppr, j = (pc - k * c.ppr) * 8;
      av[u] = load8(A + (i64)(k0 + k) * r + c0 + j, c.a_vec, k < depth ? c.cw - j : 0);
    }
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int m = m0 + u * mstep;
    if (xt && m < it.nrows) *(uint4*)(xs + m * S::LDX + kk) = xv[u];
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int e0 = (tid + u * LORA_THREADS) * 8;
    if (e0 < ntot) *(uint4*)(as + e0) = av[u];
  }
}

// acc += xs @ as over one stage's kpad16 / 16 k-steps (warp (wm, wk): rows wm*16.., k-steps
// wk, wk + WK, ...), on tensor cores.
template <int DT, int BM, int NTM>
__device__ __forceinline__ void mma_stage(float (&acc)[NTM][4], const u16* xs, const u16* as, const ChunkShape& c,
                                          int ksteps, int wm, int wk, int nrows) {
  typedef ShrinkShape<BM> S;
  for (int kstep = wk; kstep < ksteps; kstep += S::WK) {
    if (wm * 16 < nrows) {
      u32 af[4];
      load_a_frag(af, xs, S::LDX, wm * 16, kstep * 16);
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt) {
        if (nt < c.ntiles) {
          u32 bf[2];
          load_b_frag(bf, as, c.ld, kstep * 16, nt * 8);
          mma16816<DT>(acc[nt], af, bf);
        }
      }
    }
  }
}

// The warps' accumulators (k split inside the block) summed in a fixed order through shared
// memory, then the fp32 partial of this k-range (or, store_ws: v rounded to x's dtype) into
// row * R + c0 + n.
template <int DT, int BM, int NTM>
__device__ __forceinline__ void reduce_store(float* red, const float (&acc)[NTM][4], const ChunkShape& c, int c0,
                                             int wm, int wk, const LoraItem& it, u16* wsp, int R, float* part,
                                             bool store_ws) {
  typedef ShrinkShape<BM> S;
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  float* rw = red + (wk * BM + wm * 16) * S::LDR;
#pragma unroll
  for (int nt = 0; nt < NTM; ++nt) {
    if (nt < c.ntiles) {
      const int col = nt * 8 + 2 * t;
      *(float2*)(rw + g * S::LDR + col) = make_float2(acc[nt][0], acc[nt][1]);
      *(float2*)(rw + (g + 8) * S::LDR + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  __syncthreads();
  const int nout = it.nrows * c.cw;
  for (int i = tid; i < nout; i += LORA_THREADS) {
    const int m = i / c.cw, n = i - m * c.cw;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < S::WK; ++w) s += red[(w * BM + m) * S::LDR + n];
    const i64 at = (it.row0 + m) * (i64)R + c0 + n;
    if (store_ws)
      wsp[at] = from_f32<DT>(s);
    else
      part[at] = s;
  }
}

// Ranks [c0, c0 + cw) of v for the item's rows over k in [kb, ke): stages of x and of A's
// chunk in shared memory, mma.sync on tensor cores, then the fixed-order reduction and store.
template <int DT, int BM, int NTM>
__device__ __forceinline__ void shrink_chunk(unsigned char* smem, const u16* x, i64 x_stride, bool x_vec,
                                             const u16* A, int r, int c0, int kb, int ke, const LoraItem& it,
                                             u16* wsp, int R, float* part, bool store_ws) {
  typedef ShrinkShape<BM> S;
  u16* xs = (u16*)smem;
  u16* as = xs + S::XS;
  const int warp = threadIdx.x >> 5, wm = warp % S::WM, wk = warp / S::WM;
  const ChunkShape c = chunk_shape<BM, NTM>(A, r, c0);
  float acc[NTM][4];
#pragma unroll
  for (int i = 0; i < NTM; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  for (int k0 = kb; k0 < ke; k0 += c.ksd) {
    const int depth = min(c.ksd, ke - k0);
    stage_x_and_a<BM>(xs, as, x, x_stride, x_vec, A, r, c0, c, k0, depth, it);
    __syncthreads();
    mma_stage<DT, BM, NTM>(acc, xs, as, c, (depth + 15) >> 4, wm, wk, it.nrows);
    __syncthreads();
  }
  reduce_store<DT, BM, NTM>((float*)smem, acc, c, c0, wm, wk, it, wsp, R, part, store_ws);
}

// Block (ks, item, p) of a shrink launch; smem: ShrinkShape<BM>::SMEM bytes, 16-byte aligned.
template <int DT, int BM, int NTM>
__device__ __forceinline__ void shrink_body(
    int ks, int item, int p, unsigned char* smem, const u16* __restrict__ x, i64 x_stride,
    const u16* __restrict__ pool,
    const i64* __restrict__ a_off, const int* __restrict__ ranks, const int* __restrict__ table,
    int ntable, int nslots, int rows, int h_in, int layer, u16* __restrict__ ws, i64 ws_pstride,
    int R, float* __restrict__ part, int* __restrict__ counters, int ksplit, int kc,
    int items, int mode) {
  __shared__ int s_last;
  const int tid = threadIdx.x;
  ShrinkWork wk;
  if (!shrink_work(wk, p, item, BM, mode, table, ntable, nslots, rows, ranks, a_off, pool, layer, h_in, R)) return;
  const LoraItem it = wk.it;
  const int r = wk.r;
  const u16* A = wk.A;
  const int kb = ks * kc, ke = min(h_in, kb + kc);
  const bool x_vec = ((((u64)x) & 15) == 0) && ((x_stride & 7) == 0);
  // The rank in chunks of NTM * 8 (the accumulators' width): one chunk for ranks up to it, so
  // the kernel variant bounds registers, not the ranks it serves.
  for (int c0 = 0; c0 < r; c0 += NTM * 8) {
    if (c0 > 0) __syncthreads();  // the previous chunk's reduction buffer aliases the tiles
    shrink_chunk<DT, BM, NTM>(smem, x, x_stride, x_vec, A, r, c0, kb, ke, it, ws + p * ws_pstride, R,
                              part + (i64)(p * ksplit + ks) * rows * R, ksplit == 1);
  }
  if (ksplit == 1) return;

  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* c = counters + p * items + item;
    const int done = atomicAdd(c, 1);
    s_last = done == ksplit - 1;
    if (s_last) atomicExch(c, 0);
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  u16* wsp = ws + p * ws_pstride;
  const int nout = it.nrows * r;
  for (int i = tid; i < nout; i += LORA_THREADS) {
    const int m = i / r, n = i - m * r;
    const i64 row = it.row0 + m;
    wsp[row * R + n] = from_f32<DT>(sum_partials(part, p, ksplit, rows, R, row, n));
  }
}


#define LORA_SHRINK_KERNEL(NAME, DT, BM, NTM)                                                 \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS) NAME(                            \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,        \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, u16* ws,       \
      i64 ws_pstride, int R, float* part, int* counters, int ksplit, int kc, int items,       \
      int mode) {                                                                             \
    __shared__ __align__(16) unsigned char smem[ShrinkShape<BM>::SMEM];                       \
    shrink_body<DT, BM, NTM>(blockIdx.x, blockIdx.y, blockIdx.z, smem, x, x_stride, pool,     \
                             a_off, ranks, table, ntable, nslots, rows, h_in, layer, ws,      \
                             ws_pstride, R, part, counters, ksplit, kc, items, mode);         \
  }

// Prefill (64-row items): the rank chunk width by rank cap. (Decode: lora_shrink_dec.cu.)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r32, 0, 64, 4)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r64, 0, 64, 8)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r128, 0, 64, 16)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r32, 1, 64, 4)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r64, 1, 64, 8)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r128, 1, 64, 16)
