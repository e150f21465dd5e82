// Prefill SGMV expand: y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n], B_slot:
// [r, w_p], for every slice p of a fused output (q/k/v, gate/up) in one launch. A block walks
// `walk` column tiles of WALK_BN columns of one slice, for one item of EXPAND_BM rows.
//
// Grid (column groups of walk tiles over all slices, items). The block loads its item's v rows
// (every rank column) into shared memory once; then tile after tile, the y tile and B's rank rows
// for it land in one of two buffers (cp.async) while the tensor cores work on the other, the
// accumulators go into the y tile in shared memory (one rounding), and the tile goes back to y
// with 16-byte stores. Against one tile a block (H200: the rank-16 expand at T = 4096
// 26.2 -> 20.6 us, rank 128 55.6 -> 45.9), v is read from L2 once a group, not once a tile, the
// item lookup is paid once a group, and the next tile's bytes are in flight during this one.
// 8 warps, 2 along the tile's columns and 4 along its rows. On sm_90 it goes as its shrink's
// programmatic dependent: blocks placed beside the shrink's fetch their first tile, then wait for
// the shrink before they read v. On sm_90a (H100 / H200; the runtime compiles this file for it
// there) ranks above 32 are multiplied by wgmma instead: each warpgroup's 64 rows of v times the B
// tile straight from shared memory (lora_wgmma.cuh), v and B laid out in the descriptors' 128-byte
// swizzle; no ldmatrix fragments, and the tile's products off the warps' issue slots.
// (The decode path's expand is lora_expand_dec.cu.)
#include "lora_cluster.cuh"
#include "lora_expand_tiles.cuh"
#include "lora_wgmma.cuh"

// acc += the products over the rank's k16 steps where every m16 tile and column pair of the warp
// holds item rows and slice columns (every whole tile): no checks, so no warp syncs before each
// ldmatrix and mma. Each accumulator takes its k16 steps in order, as walk_mma's checked loop.
template <int DT, int MT>
__device__ __forceinline__ void walk_mma_full(float (&acc)[MT][4][4], u32 a_lane, u32 a_mstep, u32 b_lane,
                                              int ksteps) {
  for (int ks = 0; ks < ksteps; ++ks, a_lane += 16 * 2, b_lane += 16 * WALK_LD * 2) {
    u32 a[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], a_lane + i * a_mstep);
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      u32 b[4];
      ldmatrix_x4_trans(b, b_lane + jp * 16 * 2);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        mma16816<DT>(acc[i][2 * jp], a[i], b);
        mma16816<DT>(acc[i][2 * jp + 1], a[i], b + 2);
      }
    }
  }
}

// acc = v rows [wm*16*MT + 16i, +16) @ B tile columns [wn*32 + 8j, +8), over the rank's k16 steps.
// a_lane: this lane's ldmatrix address of its first v fragment (row wm*16*MT + lane % 16, column
// lane / 16 * 8 of v); b_lane: of its first B fragment in the tile's buffer (rank row
// lane / 8 % 2 * 8 + lane % 8, column wn*32 + lane / 16 * 8). Shared-window addresses set up once:
// a generic pointer's conversion for every ldmatrix was most of the loop's instructions (ncu:
// ~1,200 warp instructions a warp a tile at rank 128). mrows: the warp's m16 tiles
// that hold item rows; npairs: its 16-column pairs that hold slice columns (both warp-uniform).
template <int DT, int MT>
__device__ __forceinline__ void walk_mma(float (&acc)[MT][4][4], u32 a_lane, int ldv, u32 b_lane, int ksteps,
                                         int mrows, int npairs) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  if (mrows == MT && npairs == 2) {
    walk_mma_full<DT, MT>(acc, a_lane, 16 * ldv * 2, b_lane, ksteps);
    return;
  }
  for (int ks = 0; ks < ksteps; ++ks) {
    u32 a[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
      if (i < mrows) ldmatrix_x4(a[i], a_lane + (i * 16 * ldv + ks * 16) * 2);
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      if (jp >= npairs) continue;
      u32 b[4];
      ldmatrix_x4_trans(b, b_lane + (ks * 16 * WALK_LD + jp * 16) * 2);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        if (i < mrows) {
          mma16816<DT>(acc[i][2 * jp], a[i], b);
          mma16816<DT>(acc[i][2 * jp + 1], a[i], b + 2);
        }
      }
    }
  }
}

// acc (this warp's 16 rows of its warpgroup's 64 and the tile's 64 columns: acc[0][j], the n8 tile j,
// in mma.sync's accumulator layout) = the warpgroup's v rows @ the B tile at sb_s, over the rank's
// k16 steps (m64n64k16: v K-major, 32 bytes a step along a 64-feature block; B N-major, 16 k-rows a
// step), complete on return. Warpgroup-uniform: all of its threads or none.
template <int DT>
__device__ __forceinline__ void walk_wgmma(float (&acc)[1][8][4], u32 sv_s, u32 sb_s, int wg, int ksteps) {
  // The descriptors of step 0; a step's are theirs plus its byte offsets in 16-byte units (the
  // start address field, which no offset here carries out of).
  const u64 da = wgmma_desc(sv_s + wg * (64 * 128), 16, 1024), db = wgmma_desc(sb_s, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < LORA_MAX_RANK / 16; ++ks)
    if (ks < ksteps)
      wgmma_m64k16<64, DT>(&acc[0][0][0], da + (((ks >> 2) * (EXPAND_BM * 128) + (ks & 3) * 32) >> 4),
                           db + ((ks * 16 * 128) >> 4));
  wgmma_commit();
  wgmma_wait<0>();
}

// y tile (in shared memory) += scale * acc: each element belongs to one thread. The 16 x 16 piece
// (i, jp) of the warp's rows and columns is four 8 x 8 matrices in the accumulators' layout
// (matrix 2 jj + h: rows + 8h, columns + 8jj), so one ldmatrix loads the thread's four cells of it
// (and on sm_90 one stmatrix stores them). The warp's MT m16 tiles and NJ n8 tiles start at row
// row0, column col0; y_lane: this lane's ldmatrix address of its first piece in the tile's buffer
// (row row0 + lane / 8 % 2 * 8 + lane % 8, column col0 + lane / 16 * 8).
template <int DT, int MT, int NJ>
__device__ __forceinline__ void walk_add(u32 y_lane, u16* sy, const float (&acc)[MT][NJ][4], float scale, int row0,
                                         int col0) {
#if __CUDA_ARCH__ < 900
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#endif
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int jp = 0; jp < NJ / 2; ++jp) {
      const u32 piece = y_lane + (i * 16 * WALK_LD + jp * 16) * 2;
      u32 in[4], out[4];
      ldmatrix_x4(in, piece);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * jp + jj;
          const u32 cell = in[2 * jj + h];  // rows wm*16*MT + i*16 + g + 8h, columns wn*32 + j*8 + 2q, + 1
          const float lo = to_f32<DT>((u16)(cell & 0xffffu)) + scale * acc[i][j][2 * h];
          const float hi = to_f32<DT>((u16)(cell >> 16)) + scale * acc[i][j][2 * h + 1];
          out[2 * jj + h] = (u32)from_f32<DT>(lo) | ((u32)from_f32<DT>(hi) << 16);
#if __CUDA_ARCH__ < 900
          *(u32*)&sy[(row0 + i * 16 + g + 8 * h) * WALK_LD + col0 + j * 8 + 2 * q] = out[2 * jj + h];
#endif
        }
#if __CUDA_ARCH__ >= 900
      stmatrix_x4(piece, out);
#endif
    }
}

template <bool B>
struct WalkAll {  // expand_walk_body's tile loop: every tile whole (a compile-time tag)
  static constexpr bool value = B;
};

// The block's tiles once its work is known (expand_walk_body). NW warps (4 or 8): on the mma.sync
// path 2 along the tile's columns and NW / 2 along its rows; on the wgmma path (WG, 8 warps) each
// warp 16 rows (its warpgroup's 64, warp by warp) and all 64 columns.
template <int DT, int NW, bool WG>
__device__ __forceinline__ void walk_block(const ExpandWork& wk, u16* dsmem, const u16* __restrict__ ws,
                                           i64 ws_pstride, int R, const u16* __restrict__ pool, int layer,
                                           u16* __restrict__ y, i64 y_stride, int group, int walk) {
  constexpr int NT = NW * 32;                                // threads
  constexpr int MT = WG ? 1 : EXPAND_BM / 16 / (NW / 2);     // a warp's m16 tiles
  constexpr int NJ = WG ? WALK_BN / 8 : 4;                   // and n8 tiles
  static_assert(!WG || (NW == 8 && EXPAND_BM == 128), "two warpgroups of 64 rows");
  const int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  const int row0 = WG ? warp * 16 : wm * 16 * MT, col0 = WG ? 0 : wn * 32;  // the warp's first row and column
  const int r = wk.r, w = wk.width, nrows = wk.it.nrows, rpad = (r + 15) & ~15, ldv = walk_ldv(rpad);
  const int nfirst = (group - wk.tile0) * walk * WALK_BN;
  const int ntiles = min(walk, (w - nfirst + WALK_BN - 1) / WALK_BN);
  u16* sv = dsmem;
  if constexpr (WG) sv += ((((smem_addr(dsmem) + 1023) & ~1023u)) - smem_addr(dsmem)) / 2;
  u16* sb0 = sv + (WG ? walk_wg_v_elems(rpad) : EXPAND_BM * ldv);  // B tile of buffer b: sb0 + b * bstep
  const int bstep = WG ? rpad * WALK_BN : walk_b_elems(rpad), ystep = EXPAND_BM * WALK_LD;
  u16* sy0 = sb0 + 2 * bstep;  // y tile of buffer b: sy0 + b * ystep
  if (dynamic_smem_bytes() < (u32)(sy0 + 2 * ystep - dsmem) * 2) launch_error();  // the launcher sized less

  u16* ybase = y + (i64)wk.it.row0 * y_stride + wk.col + nfirst;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0);
  const u16* B = pool + wk.boff + (i64)layer * r * w + nfirst;
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  const u16* vsrc = ws + (i64)wk.p * ws_pstride + (i64)wk.it.row0 * R;
  const bool v_vec = ((((u64)vsrc) & 15) == 0) && ((R & 7) == 0);

  // Tile j: whole (every row, 64 columns, aligned) through the set-up pieces, else the edge copies.
  const u32 sv_s = smem_addr(sv), sb_s = smem_addr(sb0), sy_s = smem_addr(sy0);
  const WalkPieces<NT, WG> pieces(sy_s, sb_s, y_stride, w);
  const bool whole_rows = y_vec && b_vec && nrows == EXPAND_BM;
  auto load = [&](int j, int buf) {
    const int ncols = min(WALK_BN, w - nfirst - j * WALK_BN);
    if (whole_rows && ncols == WALK_BN)
      pieces.load(buf * ystep * 2, buf * bstep * 2, ybase + j * WALK_BN, B + j * WALK_BN, r, rpad);
    else
      walk_load_tile<NT, WG>(sy0 + buf * ystep, sb0 + buf * bstep, ybase + j * WALK_BN, y_stride, y_vec, nrows, ncols,
                             B + j * WALK_BN, w, b_vec, r, rpad);
  };
  // Tile 0, then v (every rank column, zeros past the rank and the item's rows) in the same copy
  // group, then tile 1. Launched as the shrink's programmatic dependent, the block gets here while
  // the shrink runs: tile 0's y and B are in flight while it waits for the shrink's v.
  if (ntiles > 0) load(0, 0);
  pdl_wait();
  const int vpr = rpad >> 3;
  for (int pc = tid; pc < EXPAND_BM * vpr; pc += NT) {
    const int m = pc / vpr, k = (pc - m * vpr) * 8;
    tile_piece(&sv[walk_v_index<WG>(m, k, ldv)], vsrc + (i64)m * R + k, vsrc, v_vec, m < nrows ? min(8, r - k) : 0);
  }
  cp_async_commit();
  if (ntiles > 1) load(1, 1);
  cp_async_commit();
  // A lane's ldmatrix addresses: v (walk_mma), and the warp's first fragment of buffer 0's B tile
  // and y tile (row lane / 8 % 2 * 8 + lane % 8 of the warp's, column col0 + lane / 16 * 8).
  const int lane = tid & 31, mat = lane >> 3;
  const u32 a_lane = sv_s + ((row0 + (lane & 15)) * ldv + (lane >> 4) * 8) * 2;
  const u32 frag = (((mat & 1) * 8 + (lane & 7)) * WALK_LD + col0 + (mat >> 1) * 8) * 2;
  const u32 b_lane0 = sb_s + frag, y_lane0 = sy_s + row0 * WALK_LD * 2 + frag;
  const int mrows = min(MT, max(0, (nrows - row0 + 15) / 16));
  // The tiles. A block whose tiles are all whole walks them in a loop of its own: no edge copy in
  // it, so none of their index math (which the compiler otherwise schedules ahead of the whole /
  // edge branch, into every tile), and every warp's m16 tiles and column pairs full.
  auto walk_tiles = [&](auto all_whole) {
    constexpr bool ALL = decltype(all_whole)::value;
    float acc[MT][NJ][4];
    for (int j = 0; j < ntiles; ++j) {
      const int buf = j & 1, ncols = min(WALK_BN, w - nfirst - j * WALK_BN);
      cp_async_wait<1>();  // tile j (and v) have landed: this thread's copies ...
      if constexpr (WG) wgmma_operands_fence();  // (written by cp.async or stores, read by the tensor cores)
      __syncthreads();     // ... and everyone's
      if constexpr (WG) {
#pragma unroll
        for (int jt = 0; jt < NJ; ++jt) acc[0][jt][0] = acc[0][jt][1] = acc[0][jt][2] = acc[0][jt][3] = 0.f;
        if ((warp / 4) * 64 < nrows)  // the warpgroup has item rows (warpgroup-uniform)
          walk_wgmma<DT>(acc, sv_s, sb_s + buf * bstep * 2, warp / 4, rpad >> 4);
      } else {
        const int npairs = min(2, max(0, (ncols - wn * 32 + 15) / 16));
        walk_mma<DT, MT>(acc, a_lane, ldv, b_lane0 + buf * bstep * 2, rpad >> 4, ALL ? MT : mrows, ALL ? 2 : npairs);
      }
      walk_add<DT, MT, NJ>(y_lane0 + buf * ystep * 2, sy0 + buf * ystep, acc, wk.scale, row0, col0);
      __syncthreads();  // the tile is whole
      if (ALL || (whole_rows && ncols == WALK_BN))
        pieces.store(ybase + j * WALK_BN, buf * ystep * 2);
      else
        walk_store<NT>(ybase + j * WALK_BN, y_stride, y_vec, sy0 + buf * ystep, nrows, ncols);
      __syncthreads();  // the buffers of tile j are free: tile j + 2 goes into them
      if (j + 2 < ntiles) {
        if (ALL)
          pieces.load(buf * ystep * 2, buf * bstep * 2, ybase + (j + 2) * WALK_BN, B + (j + 2) * WALK_BN, r, rpad);
        else
          load(j + 2, buf);
      }
      cp_async_commit();
    }
  };
  if (whole_rows && w - nfirst >= ntiles * WALK_BN)  // every tile's ncols == WALK_BN
    walk_tiles(WalkAll<true>());
  else
    walk_tiles(WalkAll<false>());
  cp_async_wait<0>();
}

// Block (group, item): its work, then its tiles on the path its rank takes.
template <int DT, int NW>
__device__ __forceinline__ void expand_walk_body(
    const u16* __restrict__ ws, i64 ws_pstride, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode, int walk, int wg_rank) {
  extern __shared__ __align__(16) u16 dsmem[];
  const int group = blockIdx.x, item = blockIdx.y;
  ExpandWork wk;
  if (!expand_work(wk, sl, nslices, group, item, EXPAND_BM, mode, table, ntable, rows, nslots, ranks, b_off, scales,
                   R))
    return;
  if constexpr (LORA_HAVE_WGMMA && NW == 8) {
    if (wk.r >= wg_rank)
      return walk_block<DT, NW, true>(wk, dsmem, ws, ws_pstride, R, pool, layer, y, y_stride, group, walk);
  }
  walk_block<DT, NW, false>(wk, dsmem, ws, ws_pstride, R, pool, layer, y, y_stride, group, walk);
}

#define LORA_EXPAND_KERNEL(NAME, DT, NW, MINB)                                                     \
  extern "C" __global__ void __launch_bounds__(NW * 32, MINB) NAME(                                \
      const u16* ws, i64 ws_pstride, int R, const u16* pool, const i64* b_off,                     \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,             \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3,      \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode, int walk, int wg_rank) {   \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};                \
    expand_walk_body<DT, NW>(ws, ws_pstride, R, pool, b_off, ranks, scales, table, ntable, nslots, \
                         rows, layer, y, y_stride, nslices, sl, mode, walk, wg_rank);              \
  }

// 8 warps, 2 blocks an SM at least (90 registers). Swept against 4 warps (4 blocks an SM) on
// the H200: the same at rank 16 under cap 16, faster where the rank cap's shared memory leaves
// 2 blocks an SM (rank 16 at cap 128: 25.9 -> 20.7 us; rank 128: 54.1 -> 45.9).
LORA_EXPAND_KERNEL(lora_expand_bf16_m128, 0, 8, 2)
LORA_EXPAND_KERNEL(lora_expand_fp16_m128, 1, 8, 2)
