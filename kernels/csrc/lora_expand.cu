// SGMV / BGMV expand: y[rows, c_p + n] += scale * (v[rows, :r] @ B_slot(layer))[:, n],
// B_slot: [r, w_p], for every slice p of a fused output (q/k/v, gate/up) in one launch.
//
// Grid (column tiles of all slices, items): block (tile, item) stages v[item rows, :r]
// (from the workspace, already rounded to the input dtype) and B[:r, tile] in shared
// memory, multiplies them on tensor cores (mma.sync, fp32 accumulate, K = r padded to 16
// with zeros), scales, then adds into y with 16-byte read-modify-writes.
#include "lora_common.cuh"

template <int BM, int BN>
struct ExpandShape {
  static constexpr int LDV = LORA_MAX_RANK + 8;  // v tile [BM][k]
  static constexpr int LDB = BN + 8;             // B tile [k][BN]
  static constexpr int LDC = BN + 4;             // fp32 result tile [BM][BN]
  static constexpr int STAGE_BYTES = (BM * LDV + LORA_MAX_RANK * LDB) * 2;
  static constexpr int C_BYTES = BM * LDC * 4;
  static constexpr int SMEM = STAGE_BYTES > C_BYTES ? STAGE_BYTES : C_BYTES;
  static constexpr int MT = BM / 16;        // m tiles per warp (each warp: all rows)
  static constexpr int NT = BN / 32;        // n tiles of 8 per warp (4 warps split BN)
};

template <int DT, int BM, int BN>
__device__ __forceinline__ void expand_body(
    const u16* __restrict__ ws, i64 ws_pstride, int R, const u16* __restrict__ pool,
    const i64* __restrict__ b_off, const int* __restrict__ ranks, const float* __restrict__ scales,
    const int* __restrict__ table, int ntable, int nslots, int rows, int layer, u16* __restrict__ y,
    i64 y_stride, int nslices, const SliceTable& sl, int mode) {
  typedef ExpandShape<BM, BN> S;
  __shared__ __align__(16) unsigned char smem[S::SMEM];
  u16* vs = (u16*)smem;
  u16* bs = vs + BM * S::LDV;
  float* cs = (float*)smem;

  const int tile = blockIdx.x, item = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  ExpandWork wk;
  if (!expand_work(wk, sl, nslices, tile, item, BM, mode, table, ntable, rows, nslots, ranks, b_off, scales, R))
    return;
  const int p = wk.p, r = wk.r, w = wk.width, n0 = (tile - wk.tile0) * BN;
  const float scale = wk.scale;
  const LoraItem it = wk.it;
  const u16* B = pool + wk.boff + (i64)layer * r * w;
  constexpr int VPR = BN / 8, YV = (BM * VPR + LORA_THREADS - 1) / LORA_THREADS;
  // y tile loads go out first: the read-modify-write at the end then waits on nothing.
  u16* ybase = y + (i64)it.row0 * y_stride + wk.col + n0;
  const bool y_vec = ((((u64)ybase) & 15) == 0) && ((y_stride & 7) == 0);
  uint4 yv[YV];
#pragma unroll
  for (int u = 0; u < YV; ++u) {
    const int v = tid + u * LORA_THREADS, m = v / VPR, n = (v - m * VPR) * 8;
    yv[u] = (y_vec && m < it.nrows && n0 + n + 8 <= w) ? *(const uint4*)(ybase + (i64)m * y_stride + n)
                                                       : make_uint4(0, 0, 0, 0);
  }
  const int rp16 = (r + 15) & ~15;

  // Stage v [BM][rp16] and B [rp16][BN]; zeros outside (rows, r, w) so padding adds 0.
  const u16* vsrc = ws + p * ws_pstride + (i64)it.row0 * R;
  const bool v_vec = ((((u64)vsrc) & 15) == 0) && ((R & 7) == 0);
  constexpr int VV = (BM * LORA_MAX_RANK / 8 + LORA_THREADS - 1) / LORA_THREADS;
  const int vrow = rp16 >> 3;  // vectors per v row
  uint4 vv[VV];
#pragma unroll
  for (int u = 0; u < VV; ++u) {  // loads first (in flight with B's), stores after B's
    const int v = tid + u * LORA_THREADS, m = v / vrow, k = (v - m * vrow) * 8;
    vv[u] = (m < it.nrows && m < BM) ? load8(vsrc + (i64)m * R + k, v_vec, r - k) : make_uint4(0, 0, 0, 0);
  }
  const bool b_vec = ((((u64)B) & 15) == 0) && ((w & 7) == 0);
  for (int v0 = tid; v0 < rp16 * VPR; v0 += LORA_THREADS * 4) {
    uint4 bv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int v = v0 + u * LORA_THREADS, k = v / VPR, n = (v - k * VPR) * 8;
      bv[u] = make_uint4(0, 0, 0, 0);
      if (v < rp16 * VPR && k < r) bv[u] = load8(B + (i64)k * w + n0 + n, b_vec, w - n0 - n);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int v = v0 + u * LORA_THREADS, k = v / VPR, n = (v - k * VPR) * 8;
      if (v < rp16 * VPR) *(uint4*)(bs + k * S::LDB + n) = bv[u];
    }
  }
#pragma unroll
  for (int u = 0; u < VV; ++u) {
    const int v = tid + u * LORA_THREADS, m = v / vrow, k = (v - m * vrow) * 8;
    if (m < BM) *(uint4*)(vs + m * S::LDV + k) = vv[u];
  }
  __syncthreads();

  float acc[S::MT][S::NT][4];
#pragma unroll
  for (int i = 0; i < S::MT; ++i)
#pragma unroll
    for (int j = 0; j < S::NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  const int wn = warp * (BN / 4);
  for (int k0 = 0; k0 < rp16; k0 += 16) {
    u32 bf[S::NT][2];
#pragma unroll
    for (int j = 0; j < S::NT; ++j) load_b_frag(bf[j], bs, S::LDB, k0, wn + j * 8);
#pragma unroll
    for (int i = 0; i < S::MT; ++i) {
      if (i * 16 < it.nrows) {
        u32 af[4];
        load_a_frag(af, vs, S::LDV, i * 16, k0);
#pragma unroll
        for (int j = 0; j < S::NT; ++j) mma16816<DT>(acc[i][j], af, bf[j]);
      }
    }
  }
  __syncthreads();
  {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < S::MT; ++i)
#pragma unroll
      for (int j = 0; j < S::NT; ++j) {
        float* c = cs + (i * 16 + g) * S::LDC + wn + j * 8 + 2 * t;
        *(float2*)c = make_float2(acc[i][j][0] * scale, acc[i][j][1] * scale);
        *(float2*)(c + 8 * S::LDC) = make_float2(acc[i][j][2] * scale, acc[i][j][3] * scale);
      }
  }
  __syncthreads();

  // y += C: 8 columns per thread and step, 16-byte read-modify-write where aligned.
#pragma unroll
  for (int u = 0; u < YV; ++u) {
    const int v = tid + u * LORA_THREADS, m = v / VPR, n = (v - m * VPR) * 8, valid = min(8, w - n0 - n);
    if (m >= it.nrows || valid <= 0) continue;
    u16* dst = ybase + (i64)m * y_stride + n;
    const float* c = cs + m * S::LDC + n;
    if (y_vec && valid == 8) {
      u32 out[4];
      const u32 in[4] = {yv[u].x, yv[u].y, yv[u].z, yv[u].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lo = to_f32<DT>((u16)(in[e] & 0xffffu)) + c[2 * e];
        const float hi = to_f32<DT>((u16)(in[e] >> 16)) + c[2 * e + 1];
        out[e] = (u32)from_f32<DT>(lo) | ((u32)from_f32<DT>(hi) << 16);
      }
      *(uint4*)dst = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
      for (int e = 0; e < valid; ++e) dst[e] = from_f32<DT>(to_f32<DT>(dst[e]) + c[e]);
    }
  }
}

#define LORA_EXPAND_KERNEL(NAME, DT, BM, BN)                                                  \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS) NAME(                            \
      const u16* ws, i64 ws_pstride, int R, const u16* pool, const i64* b_off,                \
      const int* ranks, const float* scales, const int* table, int ntable, int nslots,        \
      int rows, int layer, u16* y, i64 y_stride, int nslices, int w0, int w1, int w2, int w3, \
      int c0, int c1, int c2, int c3, int t1, int t2, int t3, int mode) {                     \
    const SliceTable sl = {{w0, w1, w2, w3}, {c0, c1, c2, c3}, {0, t1, t2, t3, 0}};           \
    expand_body<DT, BM, BN>(ws, ws_pstride, R, pool, b_off, ranks, scales, table, ntable,     \
                            nslots, rows, layer, y, y_stride, nslices, sl, mode);             \
  }

// Prefill: 64-row tiles (the decode path's expand is lora_expand_dec.cu).
LORA_EXPAND_KERNEL(lora_expand_bf16_m64, 0, 64, 64)
LORA_EXPAND_KERNEL(lora_expand_fp16_m64, 1, 64, 64)
