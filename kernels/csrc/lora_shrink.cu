// Prefill SGMV / BGMV shrink on tensor cores: v[rows of item, :r] = x[rows] @ A_slot(layer), A_slot: [h_in, r].
//
// Grid (ksplit, items, P): block (ks, item, p) multiplies the item's rows (128 at most) by the
// k-range [ks*kc, ks*kc + kc) of slice p's A, all r <= NC rank columns at once (the launcher picks
// the variant whose NC covers the rank cap). x and A go through shared memory in stages of BK input
// features, STAGES deep: cp.async copies of the next stages are in flight while the tensor cores
// (ldmatrix fragments, mma.sync m16n8k16, fp32 accumulate) work on the current one, so the x bytes,
// which bound the kernel, stream without a gap. The 4 warps split the tile WM x WN ways.
// On sm_90a (H100 / H200; the runtime compiles this file for it there) the rank-128 variant's
// TMA stages are multiplied by wgmma instead: two warpgroups of 64 rows read x and A from shared
// memory themselves (lora_wgmma.cuh), with no ldmatrix fragments and far fewer issue slots.
//
// The split-K sum. cluster = 1 (sm_90+, ksplit > 1; launched in clusters of (ksplit, 1, 1), so an
// item's ksplit blocks are one cluster, and any other launch fails): each block leaves its fp32
// partial tile in its shared memory, and block ks sums its share of the item's outputs over the
// cluster's tiles in order (distributed shared memory: deterministic, no global partials, no block
// left to sum alone) into the workspace, rounded to x's dtype. cluster = 0 (older devices): each
// block stores fp32 partials [P][ksplit][T][R] and the item's last block (an atomic counter that it
// resets to 0, so counters are zero between launches and a captured graph replays) sums them in the
// same order. ksplit = 1: the block's own tile goes to the workspace.
#include "lora_bulk.cuh"
#include "lora_cluster.cuh"
#include "lora_shrink_stages.cuh"

// acc += the warp's rows x columns of the stage at byte offset `off`; npairs: its 16-column pairs
// that hold rank columns (0: nothing to do). a_addr / b_addr: this lane's ldmatrix addresses in stage 0.
// SWZ: the x tile is the TMA's (dense 128-byte rows, 128-byte swizzle: the 16-byte chunk c of row
// m sits at chunk c ^ (m % 8)), and a_addr is the lane's row (wm * WR + lane % 16) at chunk 0; a
// lane's row is lane % 8 modulo 8 (WR and the m16 tiles are multiples of 16).
template <int DT, int NC, int BK, int STAGES, int NW, bool SWZ = false>
__device__ __forceinline__ void mma_stage(float (&acc)[ShrinkTiles<NC, BK, STAGES, NW>::MT][ShrinkTiles<NC, BK, STAGES, NW>::NT][4],
                                          u32 a_addr, u32 b_addr, u32 off, int npairs) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    u32 a[S::MT][4];
    const u32 chunk = SWZ ? ((((lane >> 4) + kk / 8) ^ (lane & 7)) << 4) : kk * 2;
#pragma unroll
    for (int i = 0; i < S::MT; ++i)
      ldmatrix_x4(a[i], a_addr + off + (SWZ ? i * 16 * BK * 2 : i * 16 * S::LDX * 2) + chunk);
#pragma unroll
    for (int np = 0; np < S::NT / 2; ++np) {
      if (np < npairs) {
        u32 b[4];
        ldmatrix_x4_trans(b, b_addr + off + (kk * S::LDA + np * 16) * 2);
#pragma unroll
        for (int i = 0; i < S::MT; ++i) {
          mma16816<DT>(acc[i][2 * np], a[i], b);
          mma16816<DT>(acc[i][2 * np + 1], a[i], b + 2);
        }
      }
    }
  }
}

// K16 steps of m64 nN k16 products along a stage: x (K-major) 32 bytes a step, A (N-major) two
// 8-row groups a step.
template <int N, int DT, int K16>
__device__ __forceinline__ void wgmma_steps(float* acc, u32 xa, u32 ab, u32 lbo) {
#pragma unroll
  for (int kk = 0; kk < K16; ++kk)
    wgmma_m64k16<N, DT>(acc, wgmma_desc(xa + kk * 32, 16, 1024), wgmma_desc(ab + kk * 2048, lbo, 1024));
}

// acc (this warpgroup's 64 rows, as ShrinkTiles' warps hold them) += its rows of the stage's x
// tile at byte offset `off` times the stage's A tile: n64 where the rank fits in 64 columns, n128
// otherwise; the products are in flight when this returns (wgmma_wait before acc or the buffers
// are touched).
template <int DT, int NC, int BK, int STAGES, int NW>
__device__ __forceinline__ void wgmma_stage(float* acc, u32 sbase, u32 off, int wg, bool n128) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  const u32 xa = sbase + off + wg * 64 * BK * 2, ab = sbase + off + S::XS * 2;
  wgmma_fence();
  if (n128)
    wgmma_steps<128, DT, BK / 16>(acc, xa, ab, S::WG_LBO);
  else
    wgmma_steps<64, DT, BK / 16>(acc, xa, ab, S::WG_LBO);
  wgmma_commit();
}

#if LORA_HAVE_BULK
// The main loop on sm_90 for whole stages: thread 0 copies each stage's x tile (SHRINK_BM rows of
// BK features from the item's first row: one TMA box, 128-byte swizzled, dense rows; rows past the
// tensor are zeros, other items' rows only reach outputs that are never stored) counted on the
// stage buffer's mbarrier (bars: STAGES of them, 8 bytes apart); every thread copies its A pieces
// (cp.async, as the other loop does). Every warp waits on both, then the loop's barrier frees the
// buffer of the stage before, which is refilled. S::WG: the warpgroups' wgmma take the stages
// (wg_active: the warpgroup has item rows), each thread's A pieces fenced for the tensor cores'
// reads, and a stage's products complete before the barrier that lets its buffer be refilled.
template <int DT, int NC, int BK, int STAGES, int NW>
__device__ __forceinline__ void shrink_tma_loop(
    float (&acc)[ShrinkTiles<NC, BK, STAGES, NW>::MT][ShrinkTiles<NC, BK, STAGES, NW>::NT][4], u32 sbase, u32 bars,
    const LoraTensorMap& xmap, StageCopies<NC, BK, STAGES, NW>& cp, int kb, int nk, const LoraItem& it,
    u32 a_row_addr, u32 b_addr, int npairs, bool active, bool wg_active, bool n128) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  static_assert(BK * 2 == 128, "one 128-byte swizzle span a row");
  const int tid = threadIdx.x;
  auto issue = [&](int s) {  // stage s into buffer s % STAGES
    const int buf = s % STAGES;
    if (tid == 0) {
      mbar_arrive_expect_tx(bars + buf * 8, SHRINK_BM * BK * 2);
      tma_load_2d(sbase + buf * S::STAGE * 2, xmap, kb + s * BK, it.row0, bars + buf * 8);
    }
    cp.issue_a(buf * S::STAGE * 2);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) issue(s);
    cp_async_commit();
  }
  for (int i = 0; i < nk; ++i) {
    mbar_wait(bars + (i % STAGES) * 8, (i / STAGES) & 1);  // stage i's x tile has landed ...
    cp_async_wait<STAGES - 2>();                           // ... and this thread's A pieces
    if constexpr (S::WG) {
      wgmma_operands_fence();  // (the A pieces, written by cp.async, are read by the tensor cores)
      wgmma_wait<0>();         // stage i - 1's products have read their buffer
    }
    __syncthreads();  // everyone's, and every warp is past stage i - 1: its buffer may be refilled
    if (i + STAGES - 1 < nk) {
      if (tid == 0) fence_proxy_async();
      issue(i + STAGES - 1);
    }
    cp_async_commit();
    if constexpr (S::WG) {
      if (wg_active) wgmma_stage<DT, NC, BK, STAGES, NW>(&acc[0][0][0], sbase, (i % STAGES) * S::STAGE * 2, threadIdx.x / 128, n128);
    } else if (active) {
      mma_stage<DT, NC, BK, STAGES, NW, true>(acc, a_row_addr, b_addr, (i % STAGES) * S::STAGE * 2, npairs);
    }
  }
  if constexpr (S::WG) wgmma_wait<0>();  // the accumulators are final
}
#endif

// v quad [n, n + 4) of item row m (valid of them in the rank) into the workspace row.
template <int DT>
__device__ __forceinline__ void store_quad(u16* dst, float4 s, int valid) {
  if (valid == 4 && (((u64)dst) & 7) == 0) {
    *(uint2*)dst = make_uint2((u32)from_f32<DT>(s.x) | ((u32)from_f32<DT>(s.y) << 16),
                              (u32)from_f32<DT>(s.z) | ((u32)from_f32<DT>(s.w) << 16));
  } else {
    const float e[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (k < valid) dst[k] = from_f32<DT>(e[k]);
  }
}

// Quads [lo, hi) of the item's nrows x ceil(cw / 4) output quads, each the sum in order over the
// partial tiles of the cluster's nsrc blocks (CL; nsrc = 1 without: this block's tile), into wsp.
template <int DT, bool CL, int NT>
__device__ __forceinline__ void sum_tiles(const float* red, int ldr, int lo, int hi, int cw, int nsrc,
                                          const LoraItem& it, u16* wsp, int R) {
  const int nq = (cw + 3) >> 2;
  const u32 rbase = smem_addr(red);
  for (int e = lo + (int)threadIdx.x; e < hi; e += NT) {
    const int m = e / nq, n = (e - m * nq) * 4;
    float4 s;
    if (CL) {
#if LORA_HAVE_CLUSTERS
      float4 t[LORA_MAX_CLUSTER];
#pragma unroll
      for (int j = 0; j < LORA_MAX_CLUSTER; ++j)  // every load in flight before the first add
        if (j < nsrc) t[j] = cluster_load4(cluster_map(rbase + (m * ldr + n) * 4, j));
      s = t[0];
#pragma unroll
      for (int j = 1; j < LORA_MAX_CLUSTER; ++j)
        if (j < nsrc) s = make_float4(s.x + t[j].x, s.y + t[j].y, s.z + t[j].z, s.w + t[j].w);
#endif
    } else {
      s = *(const float4*)&red[m * ldr + n];
    }
    store_quad<DT>(wsp + (it.row0 + m) * (i64)R + n, s, min(4, cw - n));
  }
}

// The last of an item's ksplit blocks sums their partials (in order) into the workspace.
template <int DT, int NT>
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
  // stored: one round trip to L2 per U outputs, not per output.
  constexpr int U = 4;
  const int nout = it.nrows * r;
  for (int i0 = tid; i0 < nout; i0 += U * NT) {
    float sum[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = min(i0 + u * NT, nout - 1), m = i / r;
      sum[u] = sum_partials(part, p, ksplit, rows, R, it.row0 + m, i - m * r);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + u * NT, m = i / r;
      if (i < nout) wsp[(it.row0 + m) * (i64)R + i - m * r] = from_f32<DT>(sum[u]);
    }
  }
}

// Block (ks, item, p) of a shrink launch.
template <int DT, int NC, int BK, int STAGES, int NW>
__device__ __forceinline__ void shrink_body(
    int ks, int item, int p, u16* smem_raw, const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ pool,
    const i64* __restrict__ a_off, const int* __restrict__ ranks, const int* __restrict__ table, int ntable,
    int nslots, int rows, int h_in, int layer, u16* __restrict__ ws, i64 ws_pstride, int R,
    float* __restrict__ part, int* __restrict__ counters, int ksplit, int kc, int items, int mode, int cluster,
    const LoraTensorMap& xmap, int use_tma) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  if (dynamic_smem_bytes() < (u32)S::SMEM) launch_error();  // the launcher's size (kernels/cuda/_tiles.py) is stale
  pdl_launch_dependents();  // the expand's blocks may be placed now: they fetch y and B, then wait for our v
#if LORA_HAVE_BULK
  if (use_tma && threadIdx.x == 0) tma_prefetch_map(xmap);
#endif
  const u32 sraw = smem_addr(smem_raw);
  u16* smem = smem_raw + ((((sraw + 1023) & ~1023u)) - sraw) / 2;  // 1024-byte aligned (SMEM has the slack)
#if LORA_HAVE_CLUSTERS
  if (cluster && (ksplit > LORA_MAX_CLUSTER || cluster_blocks() != ksplit)) launch_error();  // not one cluster an item
#else
  if (cluster) launch_error();  // no clusters before sm_90 (the launcher sized no global partials)
#endif
  ShrinkWork wk;  // every block of a cluster has the same item and slice: they return together
  if (!shrink_work(wk, p, item, SHRINK_BM, mode, table, ntable, nslots, rows, ranks, a_off, pool, layer, h_in, R) ||
      wk.r > NC)  // (the launcher's variant covers the rank cap, so every rank that passed)
    return;
  const LoraItem& it = wk.it;
  const int cw = wk.r, kb = ks * kc, ke = min(h_in, kb + kc);
  const bool x_vec = ((((u64)x) & 15) == 0) && ((x_stride & 7) == 0);
  const AChunk a = {wk.A, cw, 0, cw, ((((u64)wk.A) & 15) == 0) && ((cw & 7) == 0), ((((u64)wk.A) & 7) == 0) && ((cw & 3) == 0)};
  u16* wsp = ws + p * ws_pstride;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, mat = lane >> 3;
  const int wm = warp / S::WN, wn = warp % S::WN;
  const int npairs = max(0, min(S::NT / 2, (cw - wn * S::WC + 15) >> 4));  // warp-uniform
  const bool active = npairs > 0 && wm * S::WR < it.nrows;  // the warp has rank columns and item rows
  const int nk = (ke - kb + BK - 1) / BK;
  const bool fast = x_vec && (a.vec || a.vec8);
  const u32 sbase = smem_addr(smem);
  const u32 a_addr = sbase + ((wm * S::WR + (lane & 15)) * S::LDX + (lane >> 4) * 8) * 2;
  const u32 b_addr = sbase + (S::XS + ((mat & 1) * 8 + (lane & 7)) * S::LDA + wn * S::WC + (mat >> 1) * 8) * 2;
  float acc[S::MT][S::NT][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int j = 0; j < S::NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
#if LORA_HAVE_BULK
  __shared__ __align__(8) unsigned long long bars[STAGES];  // one a stage buffer (the TMA loop)
  if (use_tma && (a.vec || a.vec8) && (ke - kb) % BK == 0) {  // whole stages, x through the tensor map
    const u32 bar0 = smem_addr(bars);
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + s * 8, 1);
      mbar_init_fence();
    }
    __syncthreads();
    StageCopies<NC, BK, STAGES, NW> cp(sbase, x, x_stride, a, kb, it, S::WG);
    const u32 a_row = sbase + (wm * S::WR + (lane & 15)) * BK * 2;  // the swizzled tile's row, chunk 0
    const bool wg_active = (warp / 4) * 64 < it.nrows;  // (warpgroup-uniform, as wgmma needs)
    shrink_tma_loop<DT, NC, BK, STAGES, NW>(acc, sbase, bar0, xmap, cp, kb, nk, it, a_row, b_addr, npairs, active,
                                            wg_active, cw > 64);
  } else
#endif
  {
    StageCopies<NC, BK, STAGES, NW> cp(sbase, x, x_stride, a, kb, it, false);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage<NC, BK, STAGES, NW>(cp, smem, fast, x, x_stride, x_vec, a, kb, s, ke, it);
      cp_async_commit();
    }
    for (int i = 0; i < nk; ++i) {
      cp_async_wait<STAGES - 2>();  // stage i has landed (this thread's copies) ...
      __syncthreads();              // ... everyone's, and stage i - 1's buffer is free
      if (i + STAGES - 1 < nk)
        load_stage<NC, BK, STAGES, NW>(cp, smem, fast, x, x_stride, x_vec, a, kb, i + STAGES - 1, ke, it);
      cp_async_commit();
      if (active) mma_stage<DT, NC, BK, STAGES, NW>(acc, a_addr, b_addr, (i % STAGES) * S::STAGE * 2, npairs);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stage buffers are free: the partial tile goes over them

  const int g = lane >> 2, q = lane & 3;
  if (ksplit > 1 && !cluster) {  // fp32 partials in global memory, summed by the item's last block
    float* kpart = part + (i64)(p * ksplit + ks) * rows * R;
#pragma unroll
    for (int i = 0; i < S::MT; ++i)
#pragma unroll
      for (int j = 0; j < S::NT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int m = wm * S::WR + i * 16 + g + 8 * h, col = wn * S::WC + j * 8 + 2 * q + e;
            if (m < it.nrows && col < cw) kpart[(it.row0 + m) * (i64)R + col] = acc[i][j][2 * h + e];
          }
    finish_split<DT, S::THREADS>(p, item, items, ksplit, it, cw, rows, R, part, counters, wsp);
    return;
  }
  float* red = (float*)smem;
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *(float2*)&red[(wm * S::WR + i * 16 + g + 8 * h) * S::LDR + wn * S::WC + j * 8 + 2 * q] =
            make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
  const int total = it.nrows * ((cw + 3) >> 2);
#if LORA_HAVE_CLUSTERS
  if (cluster) {
    cluster_sync();  // every block's tile is written
    sum_tiles<DT, true, S::THREADS>(red, S::LDR, (int)((i64)total * ks / ksplit), (int)((i64)total * (ks + 1) / ksplit), cw,
                        ksplit, it, wsp, R);
    cluster_sync();  // no block leaves (freeing its tile) while another still reads it
    return;
  }
#endif
  __syncthreads();
  sum_tiles<DT, false, S::THREADS>(red, S::LDR, 0, total, cw, 1, it, wsp, R);
}

#define LORA_SHRINK_KERNEL(NAME, DT, NC, BK, STAGES, NW)                                       \
  extern "C" __global__ void __launch_bounds__(NW * 32, 2) NAME(                               \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,         \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, u16* ws,        \
      i64 ws_pstride, int R, float* part, int* counters, int ksplit, int kc, int items,        \
      int mode, int cluster, const __grid_constant__ LoraTensorMap xmap, int use_tma) {        \
    extern __shared__ __align__(16) u16 smem[];                                                \
    shrink_body<DT, NC, BK, STAGES, NW>(blockIdx.x, blockIdx.y, blockIdx.z, smem, x, x_stride, \
                                        pool, a_off, ranks, table, ntable, nslots, rows, h_in, \
                                        layer, ws, ws_pstride, R, part, counters, ksplit, kc,  \
                                        items, mode, cluster, xmap, use_tma);                  \
  }

// Prefill (128-row items), by rank cap: (NC, BK, STAGES, NW) = (32, 64, 4, 4), (64, 64, 4, 4),
// (128, 64, 3, 8) (PREFILL_SHRINK_TILES in kernels/cuda/_tiles.py, which says why). (Decode:
// lora_shrink_dec.cu.)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m128_r32, 0, 32, 64, 4, 4)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m128_r64, 0, 64, 64, 4, 4)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m128_r128, 0, 128, 64, 3, 8)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m128_r32, 1, 32, 64, 4, 4)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m128_r64, 1, 64, 64, 4, 4)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m128_r128, 1, 128, 64, 3, 8)
