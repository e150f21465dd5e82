// Prefill SGMV / BGMV shrink on tensor cores: v[rows of item, :r] = x[rows] @ A_slot(layer), A_slot: [h_in, r].
//
// Grid (ksplit, items, P): block (ks, item, p) multiplies the item's rows (64 at most) by the
// k-range [ks*kc, ks*kc + kc) of slice p's A, NC rank columns at a time (one pass for ranks up
// to the variant's NC). x and A go through shared memory in stages of BK input features,
// STAGES deep: cp.async copies of the next stages are in flight while the tensor cores
// (ldmatrix fragments, mma.sync m16n8k16, fp32 accumulate) work on the current one, so the
// x bytes, which bound the kernel, stream without a gap. Each warp owns 16 rows and all NC
// columns (no reduction inside the block). Each block stores an fp32 partial
// [P][ksplit][T][R]; then the last block of an item (an atomic counter that it resets to 0,
// so counters are zero between launches and a captured graph replays) sums them in fixed
// order (deterministic) and writes v rounded to x's dtype into the workspace. With
// ksplit = 1 the block writes the workspace directly.
#include "lora_smem.cuh"

#define SHRINK_BM 64                   // rows per item (PREFILL_BM in kernels/cuda/_launch.py)

// NC: rank columns per pass; BK: input features per stage; STAGES: stages in shared memory.
template <int NC, int BK, int STAGES>
struct ShrinkTiles {
  static constexpr int LDX = BK + 8;                 // x tile row stride (elements): conflict-free ldmatrix rows
  static constexpr int LDA = NC + 8;                 // A tile row stride (elements)
  static constexpr int XS = SHRINK_BM * LDX;         // x tile elements
  static constexpr int AS = BK * LDA;                // A tile elements
  static constexpr int STAGE = XS + AS;
  static constexpr int SMEM = STAGES * STAGE * 2;    // bytes
};

// What a block's A chunk is: columns [c0, c0 + cw) of A [h_in, r]; vec: 16-byte copies.
struct AChunk {
  const u16* A;
  int r, c0, cw;
  bool vec;
};

// Stage k in [k0, k0 + BK) of the item's x rows and of A's chunk into xs / as, any alignment and
// any k-range (a block's last stage, misaligned x or A): cp.async where aligned, zeros past the
// k-range, the item's rows and the chunk's columns, element loads and shared stores otherwise
// (visible after the barrier that precedes their use).
template <int NC, int BK, int STAGES>
__device__ __forceinline__ void load_stage_edge(u16* xs, u16* as, const u16* x, i64 x_stride, bool x_vec,
                                             const AChunk& a, int k0, int ke, const LoraItem& it) {
  typedef ShrinkTiles<NC, BK, STAGES> S;
  constexpr int XPR = BK / 8, APR = NC / 8;
  const int tid = threadIdx.x;
#pragma unroll 1
  for (int u = 0; u < SHRINK_BM * XPR / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, m = pc / XPR, kk = (pc - m * XPR) * 8;
    const int valid = m < it.nrows ? min(8, ke - k0 - kk) : 0;
    tile_piece(xs + m * S::LDX + kk, x + (i64)(it.row0 + m) * x_stride + k0 + kk, x, x_vec, valid);
  }
#pragma unroll 1
  for (int u = 0; u < (BK * APR + LORA_THREADS - 1) / LORA_THREADS; ++u) {
    const int pc = tid + u * LORA_THREADS, kr = pc / APR, j = (pc - kr * APR) * 8;
    if (kr < BK) {
      const int valid = k0 + kr < ke ? min(8, a.cw - j) : 0;
      tile_piece(as + kr * S::LDA + j, a.A + (i64)(k0 + kr) * a.r + a.c0 + j, a.A, a.vec, valid);
    }
  }
}

// The copies of one thread for every whole, aligned stage of a chunk, set up once: the global
// sources of its x and A pieces (advanced a stage at a time) and their shared addresses in
// stage 0. Pieces of rows past the item or columns past the chunk are skipped: they only feed
// outputs that are never stored (the k-range's zeros are the edge stage's business).
template <int NC, int BK, int STAGES>
struct StageCopies {
  typedef ShrinkTiles<NC, BK, STAGES> S;
  static constexpr int XPR = BK / 8, XU = SHRINK_BM * XPR / LORA_THREADS, XROWS = LORA_THREADS / XPR;
  static constexpr int APR = NC / 8, AU = BK * APR / LORA_THREADS, AROWS = LORA_THREADS / APR;
  static_assert(XU * LORA_THREADS == SHRINK_BM * XPR && AU * LORA_THREADS == BK * APR, "pieces per thread");
  const u16* xsrc;
  const u16* asrc;
  i64 xstep, astep;  // between a thread's pieces: XROWS rows of x, AROWS k-rows of A
  i64 a_stage;       // one stage of A: BK k-rows
  u32 xdst, adst;
  unsigned xok;  // bit u: x piece u's row is one of the item's
  bool aok;      // the A pieces' columns are in the chunk

  __device__ __forceinline__ StageCopies(u32 sbase, const u16* x, i64 x_stride, const AChunk& a, int kb,
                                         const LoraItem& it) {
    const int tid = threadIdx.x, m = tid / XPR, kk = (tid - m * XPR) * 8, kr = tid / APR, j = (tid - kr * APR) * 8;
    xsrc = x + (i64)(it.row0 + m) * x_stride + kb + kk;
    xstep = (i64)XROWS * x_stride;
    xdst = sbase + (m * S::LDX + kk) * 2;
    xok = 0;
#pragma unroll
    for (int u = 0; u < XU; ++u) xok |= (m + u * XROWS < it.nrows ? 1u : 0u) << u;
    asrc = a.A + (i64)(kb + kr) * a.r + a.c0 + j;
    astep = (i64)AROWS * a.r;
    a_stage = (i64)BK * a.r;
    adst = sbase + (S::XS + kr * S::LDA + j) * 2;
    aok = j < a.cw;
  }

  // Issue the next stage's copies into the stage buffer at byte offset `off`.
  __device__ __forceinline__ void issue(u32 off) {
#pragma unroll
    for (int u = 0; u < XU; ++u)
      if (xok & (1u << u)) cp_async16(xdst + off + u * XROWS * S::LDX * 2, xsrc + u * xstep);
    if (aok) {
#pragma unroll
      for (int u = 0; u < AU; ++u) cp_async16(adst + off + u * AROWS * S::LDA * 2, asrc + u * astep);
    }
    xsrc += BK;
    asrc += a_stage;
  }
};

// Stage `s` of the chunk (k from kb + s * BK) into its buffer: the fast copies when whole and
// aligned, the edge copies otherwise (the copier still advances, so later stages stay in step).
template <int NC, int BK, int STAGES>
__device__ __forceinline__ void load_stage(StageCopies<NC, BK, STAGES>& cp, u16* smem, bool fast, const u16* x,
                                           i64 x_stride, bool x_vec, const AChunk& a, int kb, int s, int ke,
                                           const LoraItem& it) {
  typedef ShrinkTiles<NC, BK, STAGES> S;
  const int buf = s % STAGES, k0 = kb + s * BK;
  if (fast && k0 + BK <= ke) {
    cp.issue(buf * S::STAGE * 2);
  } else {
    load_stage_edge<NC, BK, STAGES>(smem + buf * S::STAGE, smem + buf * S::STAGE + S::XS, x, x_stride, x_vec, a, k0,
                                    ke, it);
    cp.xsrc += BK;
    cp.asrc += cp.a_stage;
  }
}

// acc += x rows [warp * 16, + 16) of the stage at byte offset `off` @ its A chunk (ntiles n-tiles
// of 8 columns). a_addr / b_addr: this lane's ldmatrix addresses in stage 0.
template <int DT, int NC, int BK, int STAGES>
__device__ __forceinline__ void mma_stage(float (&acc)[NC / 8][4], u32 a_addr, u32 b_addr, u32 off, int ntiles) {
  typedef ShrinkTiles<NC, BK, STAGES> S;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    u32 a[4];
    ldmatrix_x4(a, a_addr + off + kk * 2);
#pragma unroll
    for (int np = 0; np < NC / 16; ++np) {
      if (2 * np < ntiles) {
        u32 b[4];
        ldmatrix_x4_trans(b, b_addr + off + (kk * S::LDA + np * 16) * 2);
        mma16816<DT>(acc[2 * np], a, b);
        mma16816<DT>(acc[2 * np + 1], a, b + 2);
      }
    }
  }
}

// Columns [c0, c0 + cw) of v for the item's rows over k in [kb, ke), stored from the warps'
// accumulators: fp32 partials at part (or, store_ws: rounded to x's dtype at wsp), row * R + col.
template <int DT, int NC, int BK, int STAGES>
__device__ __forceinline__ void shrink_chunk(u16* smem, const u16* x, i64 x_stride, bool x_vec, const AChunk& a,
                                             int kb, int ke, const LoraItem& it, u16* wsp, int R, float* part,
                                             bool store_ws) {
  typedef ShrinkTiles<NC, BK, STAGES> S;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, mat = lane >> 3;
  const int ntiles = (a.cw + 7) >> 3, nk = (ke - kb + BK - 1) / BK;
  const bool active = warp * 16 < it.nrows;  // warp-uniform: ldmatrix needs the whole warp
  const bool fast = x_vec && a.vec;
  const u32 sbase = smem_addr(smem);
  const u32 a_addr = sbase + ((warp * 16 + (lane & 15)) * S::LDX + (lane >> 4) * 8) * 2;
  const u32 b_addr = sbase + (S::XS + ((mat & 1) * 8 + (lane & 7)) * S::LDA + (mat >> 1) * 8) * 2;
  StageCopies<NC, BK, STAGES> cp(sbase, x, x_stride, a, kb, it);
  float acc[NC / 8][4];
#pragma unroll
  for (int i = 0; i < NC / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage<NC, BK, STAGES>(cp, smem, fast, x, x_stride, x_vec, a, kb, s, ke, it);
    cp_async_commit();
  }
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<STAGES - 2>();  // stage i has landed (this thread's copies) ...
    __syncthreads();              // ... everyone's, and stage i - 1's buffer is free
    if (i + STAGES - 1 < nk)
      load_stage<NC, BK, STAGES>(cp, smem, fast, x, x_stride, x_vec, a, kb, i + STAGES - 1, ke, it);
    cp_async_commit();
    if (active) mma_stage<DT, NC, BK, STAGES>(acc, a_addr, b_addr, (i % STAGES) * S::STAGE * 2, ntiles);
  }
  cp_async_wait<0>();
  __syncthreads();  // the buffers are free for the next chunk
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NC / 8; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = warp * 16 + g + 8 * h;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * t + e;
        if (m < it.nrows && col < a.cw) {
          const i64 at = (it.row0 + m) * (i64)R + a.c0 + col;
          if (store_ws)
            wsp[at] = from_f32<DT>(acc[nt][2 * h + e]);
          else
            part[at] = acc[nt][2 * h + e];
        }
      }
    }
  }
}

// The last of an item's ksplit blocks sums their partials (in order) into the workspace.
template <int DT>
__device__ __forceinline__ void finish_split(int p, int item, int items, int ksplit, const LoraItem& it, int r,
                                             int rows, int R, const float* part, int* counters, u16* wsp) {
  __shared__ int s_last;
  const int tid = threadIdx.x;
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
  // U outputs a thread at a time, every partial of all of them loaded before the first sum is
  // stored: one round trip to L2 per U outputs, not per output (an item has up to 64 x 128 outputs
  // for 128 threads; H200, rank 128, T = 4096: the shrink 83.7 -> 62.1 us against one at a time).
  constexpr int U = 4;
  const int nout = it.nrows * r;
  for (int i0 = tid; i0 < nout; i0 += U * LORA_THREADS) {
    float sum[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = min(i0 + u * LORA_THREADS, nout - 1), m = i / r;
      sum[u] = sum_partials(part, p, ksplit, rows, R, it.row0 + m, i - m * r);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * LORA_THREADS, m = i / r;
      if (i < nout) wsp[(it.row0 + m) * (i64)R + i - m * r] = from_f32<DT>(sum[u]);
    }
  }
}

// Block (ks, item, p) of a shrink launch.
template <int DT, int NC, int BK, int STAGES>
__device__ __forceinline__ void shrink_body(
    int ks, int item, int p, u16* smem, const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ pool,
    const i64* __restrict__ a_off, const int* __restrict__ ranks, const int* __restrict__ table, int ntable,
    int nslots, int rows, int h_in, int layer, u16* __restrict__ ws, i64 ws_pstride, int R,
    float* __restrict__ part, int* __restrict__ counters, int ksplit, int kc, int items, int mode) {
  ShrinkWork wk;
  if (!shrink_work(wk, p, item, SHRINK_BM, mode, table, ntable, nslots, rows, ranks, a_off, pool, layer, h_in, R))
    return;
  const int r = wk.r, kb = ks * kc, ke = min(h_in, kb + kc);
  const bool x_vec = ((((u64)x) & 15) == 0) && ((x_stride & 7) == 0);
  u16* wsp = ws + p * ws_pstride;
  float* kpart = part + (i64)(p * ksplit + ks) * rows * R;
  // The rank in chunks of NC (the accumulators' width): one chunk for ranks up to it, so the
  // kernel variant bounds registers and shared memory, not the ranks it serves.
  for (int c0 = 0; c0 < r; c0 += NC) {
    const AChunk a = {wk.A, r, c0, min(NC, r - c0), ((((u64)wk.A) & 15) == 0) && ((r & 7) == 0)};
    shrink_chunk<DT, NC, BK, STAGES>(smem, x, x_stride, x_vec, a, kb, ke, wk.it, wsp, R, kpart, ksplit == 1);
  }
  if (ksplit > 1) finish_split<DT>(p, item, items, ksplit, wk.it, r, rows, R, part, counters, wsp);
}

#define LORA_SHRINK_KERNEL(NAME, DT, NC, BK, STAGES)                                           \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS) NAME(                             \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,         \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, u16* ws,        \
      i64 ws_pstride, int R, float* part, int* counters, int ksplit, int kc, int items,        \
      int mode) {                                                                              \
    __shared__ __align__(16) u16 smem[ShrinkTiles<NC, BK, STAGES>::SMEM / 2];                  \
    shrink_body<DT, NC, BK, STAGES>(blockIdx.x, blockIdx.y, blockIdx.z, smem, x, x_stride,     \
                                    pool, a_off, ranks, table, ntable, nslots, rows, h_in,     \
                                    layer, ws, ws_pstride, R, part, counters, ksplit, kc,      \
                                    items, mode);                                              \
  }

// Prefill (64-row items): the rank chunk width by rank cap, stages of 64 input features (128
// bytes of each x row: measured 11% faster than 32 on the H200 at rank 16) where two or three
// fit in 48 KB of static shared memory, else 32. (Decode: lora_shrink_dec.cu.)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r32, 0, 32, 64, 3)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r64, 0, 64, 64, 2)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r128, 0, 128, 32, 3)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r32, 1, 32, 64, 3)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r64, 1, 64, 64, 2)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r128, 1, 128, 32, 3)
