// SGMV / BGMV shrink: v[rows of item, :r] = x[rows] @ A_slot(layer), A_slot: [h_in, r].
//
// Grid (ksplit, items, P): block (ks, item, p) multiplies the item's rows (bm of them at
// most) by the k-range [ks*kc, ks*kc + kc) of slice p's A on tensor cores (mma.sync,
// fp32 accumulate). With ksplit > 1 each block stores an fp32 partial and the last block
// of an item (counted with an atomic that it resets to 0, so the counters stay zero
// between launches and a captured graph replays) sums the partials in fixed order:
// deterministic. The result is rounded to the input dtype into the workspace.
// With partial_only (the decode path) blocks only store fp32 partials [P][ksplit][T][R];
// the decode expand (lora_expand_dec.cu) sums them.
#include "lora_common.cuh"

template <int BM>
struct ShrinkShape {
  static constexpr int WM = BM / 16;           // warps along rows
  static constexpr int WK = 4 / WM;            // warps splitting k
  static constexpr int KSD_MAX = 8192 / BM;    // k depth of one stage, at most
  static constexpr int LDX = KSD_MAX + 8;      // x tile row stride (elements)
  static constexpr int XS = BM * LDX;          // x tile elements
  static constexpr int AS = 12288;             // A tile elements: ksd * (rp16 + 8) <= this
  static constexpr int LDR = LORA_MAX_RANK + 8;
  static constexpr int STAGE_BYTES = (XS + AS) * 2;
  static constexpr int RED_BYTES = WK * BM * LDR * 4;
  static constexpr int SMEM = STAGE_BYTES > RED_BYTES ? STAGE_BYTES : RED_BYTES;
};

template <int DT, int BM>
__device__ __forceinline__ void shrink_body(
    const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ pool,
    const i64* __restrict__ a_off, const int* __restrict__ ranks, const int* __restrict__ table,
    int ntable, int nslots, int rows, int h_in, int layer, u16* __restrict__ ws, i64 ws_pstride,
    int R, float* __restrict__ part, int* __restrict__ counters, int ksplit, int kc,
    int items, int mode, int partial_only) {
  typedef ShrinkShape<BM> S;
  __shared__ __align__(16) unsigned char smem[S::SMEM];
  __shared__ int s_last;
  u16* xs = (u16*)smem;
  u16* as = xs + S::XS;
  float* red = (float*)smem;

  const int ks = blockIdx.x, item = blockIdx.y, p = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const LoraItem it = find_item(mode, table, ntable, rows, item, BM, nslots);
  if (it.slot < 0) return;
  const int r = ranks[p * nslots + it.slot];
  if (r <= 0 || r > min(R, LORA_MAX_RANK)) return;

  const u16* A = pool + a_off[p * nslots + it.slot] + (i64)layer * h_in * r;
  const int kb = ks * kc, ke = min(h_in, kb + kc);
  const int rp16 = (r + 15) & ~15, ntiles = (r + 7) >> 3, lda = rp16 + 8;
  const int ksd = min((8192 / rp16) & ~15, S::KSD_MAX);
  const int wm = warp % S::WM, wk = warp / S::WM;
  const bool x_vec = ((((u64)x) & 15) == 0) && ((x_stride & 7) == 0);

  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int k0 = kb; k0 < ke; k0 += ksd) {
    const int depth = min(ksd, ke - k0), dpad = (depth + 15) & ~15, vpr = dpad >> 3;
    // All loads of the stage are issued before any shared-memory store (8 + 8 sixteen-byte
    // loads in flight per thread): a stage is at most 1024 vectors of x and of A.
    const u16* asrc = A + (i64)k0 * r;
    const bool a_vec = (((u64)asrc) & 15) == 0;
    const int ne = depth * r, ntot = dpad * r, nxv = BM * vpr;
    uint4 xv[8], av[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int v = tid + u * LORA_THREADS, m = v / vpr, kk = (v - m * vpr) * 8;
      xv[u] = make_uint4(0, 0, 0, 0);
      if (v < nxv && m < it.nrows)
        xv[u] = load8(x + (i64)(it.row0 + m) * x_stride + k0 + kk, x_vec, depth - kk);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int e0 = (tid + u * LORA_THREADS) * 8;
      av[u] = e0 < ntot ? load8(asrc + e0, a_vec, ne - e0) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int v = tid + u * LORA_THREADS, m = v / vpr, kk = (v - m * vpr) * 8;
      if (v < nxv) *(uint4*)(xs + m * S::LDX + kk) = xv[u];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int e0 = (tid + u * LORA_THREADS) * 8;
      if (e0 < ntot) {
        int k = e0 / r, n = e0 - k * r;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (e0 + e < ntot) as[k * lda + n] = u4_get(av[u], e);
          if (++n == r) { n = 0; ++k; }
        }
      }
    }
    __syncthreads();
    for (int kstep = wk; kstep < (dpad >> 4); kstep += S::WK) {
      u32 af[4];
      load_a_frag(af, xs, S::LDX, wm * 16, kstep * 16);
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        if (nt < ntiles) {
          u32 bf[2];
          load_b_frag(bf, as, lda, kstep * 16, nt * 8);
          mma16816<DT>(acc[nt], af, bf);
        }
      }
    }
    __syncthreads();
  }

  // Cross-warp (k-split inside the block) reduction through shared memory, fixed order.
  {
    const int g = lane >> 2, t = lane & 3;
    float* rw = red + (wk * BM + wm * 16) * S::LDR;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      if (nt < ntiles) {
        const int c = nt * 8 + 2 * t;
        *(float2*)(rw + g * S::LDR + c) = make_float2(acc[nt][0], acc[nt][1]);
        *(float2*)(rw + (g + 8) * S::LDR + c) = make_float2(acc[nt][2], acc[nt][3]);
      }
    }
  }
  __syncthreads();
  u16* wsp = ws + p * ws_pstride;
  const int nout = it.nrows * r;
  for (int i = tid; i < nout; i += LORA_THREADS) {
    const int m = i / r, n = i - m * r;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < S::WK; ++w) s += red[(w * BM + m) * S::LDR + n];
    const i64 row = it.row0 + m;
    if (ksplit == 1 && !partial_only)
      wsp[row * R + n] = from_f32<DT>(s);
    else
      part[(((i64)p * ksplit + ks) * rows + row) * R + n] = s;
  }
  if (ksplit == 1 || partial_only) return;

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
  for (int i = tid; i < nout; i += LORA_THREADS) {
    const int m = i / r, n = i - m * r;
    const i64 row = it.row0 + m;
    wsp[row * R + n] = from_f32<DT>(sum_partials(part, p, ksplit, rows, R, row, n));
  }
}

#define LORA_SHRINK_KERNEL(NAME, DT, BM)                                                      \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS) NAME(                            \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,        \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, u16* ws,       \
      i64 ws_pstride, int R, float* part, int* counters, int ksplit, int kc, int items,       \
      int mode, int partial_only) {                                                           \
    shrink_body<DT, BM>(x, x_stride, pool, a_off, ranks, table, ntable, nslots, rows, h_in,  \
                        layer, ws, ws_pstride, R, part, counters, ksplit, kc, items, mode,   \
                        partial_only);                                                       \
  }

LORA_SHRINK_KERNEL(lora_shrink_bf16_m16, 0, 16)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64, 0, 64)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m16, 1, 16)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64, 1, 64)
