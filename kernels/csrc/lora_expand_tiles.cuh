// The prefill expand's tiles (lora_expand.cu): where a block's v rows, B tiles and y tiles sit in
// its shared memory on the mma.sync and the wgmma path, and the copies between them and global
// memory (the whole tiles' set-up pieces, the edge tiles' checked copies, the y tile's store).
#pragma once
#include "lora_smem.cuh"

#define EXPAND_BM 128  // rows per item (PREFILL_BM in kernels/cuda/_plan.py)

#define WALK_BN 64              // columns a tile
#define WALK_LD (WALK_BN + 8)   // y and B tile row stride (elements): conflict-free ldmatrix rows

// Ranks from WALK_WG_MIN_RANK take wgmma on sm_90a: the launcher passes it (wg_rank, from
// kernels/cuda/_tiles.py, which a test lowers to compare the two paths); here it sizes the layouts.
#define WALK_WG_MIN_RANK 33

// Shared memory of a block whose rank rounds up to rpad (a multiple of 16), in elements: v, then
// two B tiles, then two y tiles. The mma.sync path: padded rows (ldmatrix without bank
// conflicts). The wgmma path (WG): from the allocation's first 1024-byte boundary (the swizzle's
// period), v as 64-feature blocks of EXPAND_BM dense 128-byte rows (the prefill shrink's x tile),
// each B tile as rpad k-rows of its 64 columns, 128 bytes each (the shrink's A tile at n64), the
// 16-byte chunk c of a row r at chunk c ^ (r % 8); the y tiles as on the other path. A launch
// gives a block walk_smem_elems of its rank cap: either layout of any rank up to it (the kernel
// traps if it was given less; walk_smem_bytes in kernels/cuda/_tiles.py mirrors it).
__host__ __device__ constexpr int walk_ldv(int rpad) { return rpad + 8; }
__host__ __device__ constexpr int walk_b_elems(int rpad) { return rpad * WALK_LD; }
__host__ __device__ constexpr int walk_mma_smem_elems(int rpad) {
  return EXPAND_BM * walk_ldv(rpad) + 2 * walk_b_elems(rpad) + 2 * EXPAND_BM * WALK_LD;
}
__host__ __device__ constexpr int walk_wg_v_elems(int rpad) { return EXPAND_BM * ((rpad + 63) & ~63); }
__host__ __device__ constexpr int walk_wg_smem_elems(int rpad) {
  return 1024 / 2 + walk_wg_v_elems(rpad) + 2 * rpad * WALK_BN + 2 * EXPAND_BM * WALK_LD;
}
__host__ __device__ constexpr int walk_smem_elems(int rpad) {
  return rpad < WALK_WG_MIN_RANK || walk_mma_smem_elems(rpad) >= walk_wg_smem_elems(rpad) ? walk_mma_smem_elems(rpad)
                                                                                          : walk_wg_smem_elems(rpad);
}
static_assert(WALK_BN * 2 == 128, "a B tile row is one 128-byte swizzle span");

// Element index of v[m][k] and of the B tile's [kr][n] in their layout (k, n multiples of 8).
template <bool WG>
__device__ __forceinline__ int walk_v_index(int m, int k, int ldv) {
  if constexpr (WG) return (k >> 6) * (EXPAND_BM * 64) + m * 64 + ((((k >> 3) ^ m) & 7) << 3);
  return m * ldv + k;
}
template <bool WG>
__device__ __forceinline__ int walk_b_index(int kr, int n) {
  if constexpr (WG) return kr * WALK_BN + ((((n >> 3) ^ kr) & 7) << 3);
  return kr * WALK_LD + n;
}

// Tile n0's y piece (rows past the item, columns past the slice: zeros, never stored) and B's
// rank rows for it (rows past the rank: zeros) into sy / sb.
template <int NT, bool WG>
__device__ __forceinline__ void walk_load_tile(u16* sy, u16* sb, const u16* ytile, i64 y_stride, bool y_vec,
                                               int nrows, int ncols, const u16* btile, i64 w, bool b_vec, int r,
                                               int rpad) {
  const int tid = threadIdx.x;
  constexpr int PR = WALK_BN / 8;  // 16-byte pieces a row
#pragma unroll
  for (int u = 0; u < EXPAND_BM * PR / NT; ++u) {
    const int pc = tid + u * NT, m = pc / PR, n = (pc - m * PR) * 8;
    tile_piece(&sy[m * WALK_LD + n], ytile + (i64)m * y_stride + n, ytile, y_vec, m < nrows ? min(8, ncols - n) : 0);
  }
  for (int pc = tid; pc < rpad * PR; pc += NT) {
    const int kr = pc / PR, n = (pc - kr * PR) * 8;
    tile_piece(&sb[walk_b_index<WG>(kr, n)], btile + (i64)kr * w + n, btile, b_vec, kr < r ? min(8, ncols - n) : 0);
  }
}

// One thread's pieces of a whole tile (every row of the item, every column, aligned), set up once a
// block: its first y piece (row pm, columns pn .. pn + 7) and the ones YROWS rows apart; its B
// pieces are rows pm, pm + YROWS, ... of the same columns (BU at most: the rank is at most
// LORA_MAX_RANK). Shared addresses are 32-bit shared-window ones of buffer 0 (a buffer's byte
// offset added), and global ones offsets from the tile's first element, so a tile's copies are an
// add each. The edge tiles take walk_load_tile and walk_store instead (their index math and bounds
// checks are most of a tile's instructions).
template <int NT, bool WG>
struct WalkPieces {
  static constexpr int PR = WALK_BN / 8, YU = EXPAND_BM * PR / NT, YROWS = NT / PR;
  static constexpr int BU = (LORA_MAX_RANK + YROWS - 1) / YROWS;
  static constexpr int BROW = WG ? WALK_BN * 2 : WALK_LD * 2;  // bytes between B tile rows
  static_assert(YROWS % 8 == 0, "a thread's B rows share their swizzle");
  int pm;                             // the first piece's row
  u32 sy, sb;                         // its shared addresses in buffer 0's y and B tiles
  i64 ypiece, yrows, bpiece, brows;  // element offsets in y and B: the first piece, YROWS rows

  __device__ __forceinline__ WalkPieces(u32 sy0, u32 sb0, i64 y_stride, i64 w) {
    pm = threadIdx.x / PR;
    const int pn = (threadIdx.x - pm * PR) * 8;
    sy = sy0 + (pm * WALK_LD + pn) * 2;
    sb = sb0 + walk_b_index<WG>(pm, pn) * 2;
    ypiece = (i64)pm * y_stride + pn;
    yrows = (i64)YROWS * y_stride;
    bpiece = (i64)pm * w + pn;
    brows = (i64)YROWS * w;
  }

  // Into the buffer at byte offsets yoff / boff of buffer 0's tiles: rows past the rank are zeros.
  __device__ __forceinline__ void load(u32 yoff, u32 boff, const u16* ytile, const u16* btile, int r, int rpad) const {
    const u16* src = ytile + ypiece;
#pragma unroll
    for (int u = 0; u < YU; ++u) cp_async16(sy + yoff + u * YROWS * WALK_LD * 2, src + u * yrows);
    const u16* bsrc = btile + bpiece;
#pragma unroll
    for (int u = 0; u < BU; ++u) {  // row pm + u * YROWS; kr < rpad is warp-uniform (a warp's 4 rows, rpad % 16 == 0)
      const int kr = pm + u * YROWS;
      if (kr < rpad)
        cp_async16_zfill(sb + boff + u * YROWS * BROW, kr < r ? bsrc + u * brows : btile, kr < r ? 16 : 0);
    }
  }

  __device__ __forceinline__ void store(u16* ytile, u32 yoff) const {
    u16* dst = ytile + ypiece;
#pragma unroll
    for (int u = 0; u < YU; ++u) stg128(dst + u * yrows, lds128(sy + yoff + u * YROWS * WALK_LD * 2));
  }
};

// The y tile back to y: 16-byte stores where aligned and whole, elements at the slice's edge.
template <int NT>
__device__ __forceinline__ void walk_store(u16* ytile, i64 y_stride, bool y_vec, const u16* sy, int nrows, int ncols) {
  const int tid = threadIdx.x;
  constexpr int PR = WALK_BN / 8;
#pragma unroll
  for (int u = 0; u < EXPAND_BM * PR / NT; ++u) {
    const int pc = tid + u * NT, m = pc / PR, n = (pc - m * PR) * 8, valid = min(8, ncols - n);
    if (m >= nrows || valid <= 0) continue;
    u16* dst = ytile + (i64)m * y_stride + n;
    const u16* src = &sy[m * WALK_LD + n];
    if (y_vec && valid == 8) {
      *(uint4*)dst = *(const uint4*)src;
    } else {
      for (int e = 0; e < valid; ++e) dst[e] = src[e];
    }
  }
}
