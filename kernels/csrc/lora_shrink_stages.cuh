// The prefill shrink's tiles and the copies that fill its stages (lora_shrink.cu): the variant's
// tile geometry (ShrinkTiles, mirrored for the launcher in kernels/cuda/_tiles.py), the A chunk a
// block reads, and each thread's global -> shared copies of x and A for a stage: cp.async pieces
// set up once for whole, aligned stages (StageCopies), element loads and zero fill for the rest
// (load_stage_edge).
#pragma once
#include "lora_smem.cuh"
#include "lora_wgmma.cuh"

#define SHRINK_BM 128  // rows per item (PREFILL_BM in kernels/cuda/_plan.py)

// NC: rank columns; BK: input features per stage; STAGES: stages in shared memory; NW: warps (4 or
// 8). (The launcher mirrors SMEM: kernels/cuda/_tiles.py; the kernel traps if it was given less.)
template <int NC, int BK, int STAGES, int NW>
struct ShrinkTiles {
  static constexpr int THREADS = NW * 32;
  // wgmma (sm_90a, the rank-128 variant): whole stages whose x came by TMA go to two warpgroups of
  // 64 rows and every column; the A tile is then laid out for the tensor cores' descriptors
  // (lora_wgmma.cuh), WG_LBO bytes between its 64-column halves. The warps' rows and columns below
  // are the wgmma accumulators' (each warp 16 rows, every column) for both loops.
  static constexpr bool WG = LORA_HAVE_WGMMA && NC == 128 && BK == 64 && NW == 8;
  static constexpr int WG_LBO = BK / 8 * 1024;
  static constexpr int WN = WG ? 1 : NC >= 128 ? 2 : 1, WM = NW / WN;  // warps along the rows / the columns
  static constexpr int WR = SHRINK_BM / WM, WC = NC / WN;    // a warp's rows / columns
  static constexpr int MT = WR / 16, NT = WC / 8;            // its m16 / n8 tiles
  static constexpr int LDX = BK + 8;                         // x tile row stride (elements): conflict-free ldmatrix rows
  static constexpr int LDA = NC + 8;                         // A tile row stride (elements)
  static constexpr int XS = SHRINK_BM * LDX;                 // x tile elements
  static constexpr int AS = BK * LDA;                        // A tile elements
  static constexpr int STAGE = XS + AS;
  static constexpr int LDR = NC + 4;  // the fp32 partial tile's row stride (16-byte rows), over the stages after the loop
  static constexpr int PIPE = STAGES * STAGE * 2, RED = SHRINK_BM * LDR * 4;
  // bytes: the stages from the first 1024-byte boundary of the dynamic shared memory (the TMA's
  // 128-byte swizzle needs it), hence the slack
  static constexpr int SMEM = (PIPE > RED ? PIPE : RED) + 1024;
};

// What a block's A chunk is: columns [c0, c0 + cw) of A [h_in, r]; vec: 16-byte copies; vec8:
// 8-byte copies (ranks that are multiples of 4, not of 8).
struct AChunk {
  const u16* A;
  int r, c0, cw;
  bool vec, vec8;
};

// Stage k in [k0, k0 + BK) of the item's x rows and of A's chunk into xs / as, any alignment and
// any k-range (a block's last stage, misaligned x or A): cp.async where aligned, zeros past the
// k-range, the item's rows and the chunk's columns, element loads and shared stores otherwise
// (visible after the barrier that precedes their use).
template <int NC, int BK, int STAGES, int NW>
__device__ __forceinline__ void load_stage_edge(u16* xs, u16* as, const u16* x, i64 x_stride, bool x_vec,
                                             const AChunk& a, int k0, int ke, const LoraItem& it) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  constexpr int XPR = BK / 8, APR = NC / 8;
  const int tid = threadIdx.x;
#pragma unroll 1
  for (int u = 0; u < SHRINK_BM * XPR / S::THREADS; ++u) {
    const int pc = tid + u * S::THREADS, m = pc / XPR, kk = (pc - m * XPR) * 8;
    const int valid = m < it.nrows ? min(8, ke - k0 - kk) : 0;
    tile_piece(xs + m * S::LDX + kk, x + (i64)(it.row0 + m) * x_stride + k0 + kk, x, x_vec, valid);
  }
#pragma unroll 1
  for (int u = 0; u < (BK * APR + S::THREADS - 1) / S::THREADS; ++u) {
    const int pc = tid + u * S::THREADS, kr = pc / APR, j = (pc - kr * APR) * 8;
    if (kr < BK) {
      const int valid = k0 + kr < ke ? min(8, a.cw - j) : 0;
      tile_piece(as + kr * S::LDA + j, a.A + (i64)(k0 + kr) * a.r + a.c0 + j, a.A, a.vec, valid);
    }
  }
}

// The copies of one thread for every whole, aligned stage of a chunk, set up once: the global
// sources of its x and A pieces (advanced a stage at a time) and their shared addresses in
// stage 0. Pieces of rows past the item or columns past the chunk are skipped: they only feed
// outputs that are never stored (the k-range's zeros are the edge stage's business). A's pieces
// are 16 bytes, or 8 where only that is aligned (a8: twice as many, half as many rows apart).
template <int NC, int BK, int STAGES, int NW>
struct StageCopies {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  static constexpr int T = S::THREADS;
  static constexpr int XPR = BK / 8, XU = SHRINK_BM * XPR / T, XROWS = T / XPR;
  static constexpr int APR = NC / 8, AU = BK * APR / T, AROWS = T / APR;
  static_assert(XU * T == SHRINK_BM * XPR && AU * T == BK * APR && XU <= 32, "pieces per thread");
  const u16* xsrc;
  const u16* asrc;
  i64 xstep, astep;  // between a thread's pieces: XROWS rows of x, AROWS k-rows of A
  i64 a_stage;       // one stage of A: BK k-rows
  u32 xdst, adst;
  u32 adst_step;     // between a thread's A pieces in shared memory
  unsigned xok;  // bit u: x piece u's row is one of the item's
  bool aok;      // the A pieces' columns are in the chunk
  bool a8;       // 8-byte A pieces

  // wg_layout: the A tile as the wgmma descriptors read it (S::WG; else the padded rows ldmatrix reads).
  __device__ __forceinline__ StageCopies(u32 sbase, const u16* x, i64 x_stride, const AChunk& a, int kb,
                                         const LoraItem& it, bool wg_layout) {
    a8 = !a.vec && a.vec8;
    const int apr = a8 ? 2 * APR : APR, arows = T / apr;  // A pieces a k-row, k-rows a round of pieces
    const int tid = threadIdx.x, m = tid / XPR, kk = (tid - m * XPR) * 8, kr = tid / apr, j = (tid - kr * apr) * (a8 ? 4 : 8);
    xsrc = x + (i64)(it.row0 + m) * x_stride + kb + kk;
    xstep = (i64)XROWS * x_stride;
    xdst = sbase + (m * S::LDX + kk) * 2;
    xok = 0;
#pragma unroll
    for (int u = 0; u < XU; ++u) xok |= (m + u * XROWS < it.nrows ? 1u : 0u) << u;
    asrc = a.A + (i64)(kb + kr) * a.r + a.c0 + j;
    astep = (i64)arows * a.r;
    a_stage = (i64)BK * a.r;
    if (wg_layout) {  // half j / 64, 8-row group kr / 8, row kr % 8 of it, the 16-byte chunk swizzled by the row
      static_assert(AROWS % 16 == 0, "a thread's A pieces keep their row within the 8-row group");
      adst = sbase + S::XS * 2 + (j / 64) * S::WG_LBO + (kr / 8) * 1024 + (kr % 8) * 128 +
             ((((j % 64) / 8) ^ (kr % 8)) << 4) + (j % 8) * 2;
      adst_step = arows / 8 * 1024;
    } else {
      adst = sbase + (S::XS + kr * S::LDA + j) * 2;
      adst_step = arows * S::LDA * 2;
    }
    aok = j < a.cw;
  }

  // Issue the next stage's copies into the stage buffer at byte offset `off`.
  __device__ __forceinline__ void issue(u32 off) {
#pragma unroll
    for (int u = 0; u < XU; ++u)
      if (xok & (1u << u)) cp_async16(xdst + off + u * XROWS * S::LDX * 2, xsrc + u * xstep);
    xsrc += BK;
    issue_a(off);
  }

  // The A pieces alone (x comes by TMA).
  __device__ __forceinline__ void issue_a(u32 off) {
    if (aok && a8) {
#pragma unroll
      for (int u = 0; u < 2 * AU; ++u) cp_async8(adst + off + u * adst_step, asrc + u * astep);
    } else if (aok) {
#pragma unroll
      for (int u = 0; u < AU; ++u) cp_async16(adst + off + u * adst_step, asrc + u * astep);
    }
    asrc += a_stage;
  }
};

// Stage `s` of the chunk (k from kb + s * BK) into its buffer: the fast copies when whole and
// aligned, the edge copies otherwise (the copier still advances, so later stages stay in step).
template <int NC, int BK, int STAGES, int NW>
__device__ __forceinline__ void load_stage(StageCopies<NC, BK, STAGES, NW>& cp, u16* smem, bool fast, const u16* x,
                                           i64 x_stride, bool x_vec, const AChunk& a, int kb, int s, int ke,
                                           const LoraItem& it) {
  typedef ShrinkTiles<NC, BK, STAGES, NW> S;
  const int buf = s % STAGES, k0 = kb + s * BK;
  if (fast && k0 + BK <= ke) {
    cp.issue(buf * S::STAGE * 2);
  } else {
    load_stage_edge<NC, BK, STAGES, NW>(smem + buf * S::STAGE, smem + buf * S::STAGE + S::XS, x, x_stride, x_vec, a, k0,
                                    ke, it);
    cp.xsrc += BK;
    cp.asrc += cp.a_stage;
  }
}
