// Shared helpers of the LoRA SGMV/BGMV kernels (shrink and expand).
//
// No CUDA headers are included: bf16/fp16 travel as raw 16-bit words and are converted
// with inline PTX, and the tensor-core product is inline PTX mma.sync m16n8k16, so the
// sources compile the same under NVRTC (CuPy) and nvcc without include paths.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define LORA_THREADS 128
#define LORA_MAX_RANK 128

// DT = 0: bfloat16, DT = 1: float16.
template <int DT> __device__ __forceinline__ float to_f32(u16 h);
template <> __device__ __forceinline__ float to_f32<0>(u16 h) {
  return __uint_as_float(((u32)h) << 16);
}
template <> __device__ __forceinline__ float to_f32<1>(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int DT> __device__ __forceinline__ u16 from_f32(float f);
template <> __device__ __forceinline__ u16 from_f32<0>(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ u16 from_f32<1>(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// c[0..3] += A(16x16, row) * B(16x8, col), fp32 accumulate.
template <int DT> __device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b);
template <> __device__ __forceinline__ void mma16816<0>(float* c, const u32* a, const u32* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<1>(float* c, const u32* a, const u32* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Programmatic dependent launch (kernels/cuda/_launch_ex.py; sm_90 and later, no-ops before):
// a kernel lets the one launched after it start early, and that one waits for it to complete
// before reading what it wrote. Without the launch attribute both return at once.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#define LORA_MAX_SLICES 4

struct SliceTable {
  int width[LORA_MAX_SLICES];      // w_p: columns of slice p
  int col[LORA_MAX_SLICES];        // c_p: first column of slice p in y
  int tile0[LORA_MAX_SLICES + 1];  // first column tile of slice p (prefix sums)
};

// One unit of work: rows [row0, row0 + nrows) of the batch, all using adapter `slot`.
struct LoraItem {
  int slot;
  int row0;
  int nrows;
};

// Tiles of bm rows of segment i beyond its first one (rows clamped to [0, rows)).
__device__ __forceinline__ int seg_extra_tiles(const int* seg, int i, int rows, int bm) {
  const int lo = max(0, min(seg[i], rows));
  const int hi = max(lo, min(seg[i + 1], rows));
  return hi - lo > bm ? (hi - lo - 1) / bm : 0;
}

// SGMV work items. Item i < nseg is the first tile (bm rows at most) of segment i: found
// with two loads, no scan, so decode batches (short segments) pay one memory round trip.
// Item nseg + j is the j-th further tile, counting the further tiles of every segment in
// order (a block-wide scan of seg in shared memory; every thread of the block calls this).
// slot = -1: no such tile (empty segment, or past the last tile).
__device__ LoraItem sgmv_item(const int* seg, int nseg, int rows, int item, int bm) {
  LoraItem it;
  it.slot = -1;
  it.row0 = 0;
  it.nrows = 0;
  if (item < nseg) {
    const int lo = max(0, min(seg[item], rows));
    const int hi = max(lo, min(seg[item + 1], rows));
    if (hi > lo) {
      it.slot = item;
      it.row0 = lo;
      it.nrows = min(bm, hi - lo);
    }
    return it;
  }
  __shared__ int s_warp[32];  // one a warp: any block size (the prefill shrink runs 128 or 256 threads)
  __shared__ LoraItem s_item;
  const int extra = item - nseg;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
  if (tid == 0) s_item = it;
  const int per = (nseg + nthreads - 1) / nthreads;
  const int lo = min(nseg, tid * per), hi = min(nseg, lo + per);
  int local = 0;
  for (int i = lo; i < hi; ++i) local += seg_extra_tiles(seg, i, rows, bm);
  int incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int acc = incl - local;
  for (int w = 0; w < warp; ++w) acc += s_warp[w];
  if (extra >= acc && extra < acc + local) {
    for (int i = lo; i < hi; ++i) {
      const int c = seg_extra_tiles(seg, i, rows, bm);
      if (extra < acc + c) {
        const int start = max(0, min(seg[i], rows));
        const int end = max(start, min(seg[i + 1], rows));
        const int row0 = start + (1 + extra - acc) * bm;
        s_item.slot = i;
        s_item.row0 = row0;
        s_item.nrows = min(bm, end - row0);
        break;
      }
      acc += c;
    }
  }
  __syncthreads();
  return s_item;
}

// BGMV: item = one row; its slot from row_slot (-1 or out of range: none).
__device__ __forceinline__ LoraItem bgmv_item(const int* row_slot, int rows, int item, int nslots) {
  LoraItem it;
  it.slot = -1;
  it.row0 = item;
  it.nrows = 1;
  if (item < rows) {
    const int s = row_slot[item];
    if (s >= 0 && s < nslots) it.slot = s;
  }
  return it;
}

// SGMV by rows (decode batches of a few rows): item = row `row`, in the segment i with
// seg[i] <= row < seg[i + 1], found by the whole block at once (each thread tests segments
// tid, tid + 128, ...: one round of loads, where a segment's 4-row tiles would leave most of
// the device idle for grouped batches). The largest such i wins, so the result does not
// depend on thread timing even for a malformed seg. Every thread of the block calls this.
// A Distinct batch's row t is segment t: that guess is tested first, and where it holds (the
// same answer in every thread) the block skips the search and its barriers. (The engine passes
// row_slot, so its calls take BGMV items instead; this serves callers that give seg alone.)
// Not inlined: inlined, it pushed the decode expand (6 blocks an SM) into spilling registers.
__device__ __noinline__ LoraItem seg_row_item(const int* seg, int nseg, int rows, int row) {
  __shared__ int s_slot;
  LoraItem it;
  it.row0 = row;
  it.nrows = 1;
  it.slot = -1;
  if (row >= rows) return it;  // uniform: row is the block's item
  const bool guess_ok = row < nseg && seg[row] <= row && row < seg[row + 1];
  if (guess_ok) {
    it.slot = row;
    return it;
  }
  if (threadIdx.x == 0) s_slot = -1;
  __syncthreads();
  for (int i = threadIdx.x; i < nseg; i += LORA_THREADS)
    if (seg[i] <= row && row < seg[i + 1]) atomicMax(&s_slot, i);
  __syncthreads();
  it.slot = s_slot;
  return it;
}

#define LORA_RUN_ROWS 4  // rows a run item takes at most (SHRINK_DEC_NR, DEC_ROWS)

// Runs of row_slot (decode calls past ONE_ROW_ITEMS_ROWS rows, kernels/cuda/_plan.py): item t is
// row t, and it works when it heads a run, i.e. it is the first row of its segment in its aligned
// window of LORA_RUN_ROWS rows; it takes that segment's rows of the window. Each segment is then cut
// into 4-row tiles (a staged B tile serves up to four rows) with no scan over the segments, which
// sgmv_item needs for every tile past a segment's first. The window's row_slot entries are loaded
// together (one round trip); rows that head no run, and rows without an adapter, exit.
// Not inlined, as seg_row_item: inlined, its loads pushed the decode expand into spilling registers.
__device__ __noinline__ LoraItem run_item(const int* row_slot, int rows, int item, int nslots) {
  LoraItem it;
  it.slot = -1;
  it.row0 = item;
  it.nrows = 0;
  if (item >= rows) return it;
  const int w0 = item - item % LORA_RUN_ROWS, w1 = min(rows, w0 + LORA_RUN_ROWS);
  const int s = row_slot[item];
  const int prev = item > w0 ? row_slot[item - 1] : -1;
  int next[LORA_RUN_ROWS - 1];
#pragma unroll
  for (int j = 0; j < LORA_RUN_ROWS - 1; ++j) next[j] = item + 1 + j < w1 ? row_slot[item + 1 + j] : -1;
  if (s < 0 || s >= nslots || (item > w0 && prev == s)) return it;
  int n = 1;
#pragma unroll
  for (int j = 0; j < LORA_RUN_ROWS - 1; ++j)
    if (n == j + 1 && next[j] == s) n = j + 2;
  it.slot = s;
  it.nrows = n;
  return it;
}

#define LORA_MODE_SGMV 0       // table = seg, items = bm-row tiles of segments
#define LORA_MODE_BGMV 1       // table = row_slot, items = rows
#define LORA_MODE_SGMV_ROWS 2  // table = seg, items = rows (seg_row_item)
#define LORA_MODE_RUNS 3       // table = row_slot (the layout of seg), items = rows heading runs (run_item)

// Uniform per block: the branch on mode and on item < ntable is the same for all threads.
__device__ __forceinline__ LoraItem find_item(int mode, const int* table, int ntable, int rows,
                                              int item, int bm, int nslots) {
  if (mode == LORA_MODE_SGMV) return sgmv_item(table, ntable, rows, item, bm);
  if (mode == LORA_MODE_SGMV_ROWS) return seg_row_item(table, ntable, rows, item);
  if (mode == LORA_MODE_RUNS) return run_item(table, rows, item, nslots);
  return bgmv_item(table, rows, item, nslots);
}

// The slot an item has when it is a direct SGMV item (item < S), or the likely one of a row item
// (row t in segment t: a Distinct batch): its tables can be read before (in parallel with) the
// segment bounds. -1 otherwise (items found through row_slot).
__device__ __forceinline__ int direct_slot(int mode, int ntable, int item) {
  return ((mode == LORA_MODE_SGMV || mode == LORA_MODE_SGMV_ROWS) && item < ntable) ? item : -1;
}

// What one shrink block works on: item `item` (rows of one adapter) and that adapter's rank
// and A for slice p at `layer`. A direct SGMV item's tables are read in parallel with its
// segment bounds. False: nothing to do (no adapter, or a rank outside [1, min(R, LORA_MAX_RANK)]).
struct ShrinkWork {
  LoraItem it;
  int r;
  const u16* A;  // [h_in, r] of this layer
};

__device__ __forceinline__ bool shrink_work(ShrinkWork& wk, int p, int item, int bm, int mode, const int* table,
                                            int ntable, int nslots, int rows, const int* ranks, const i64* a_off,
                                            const u16* pool, int layer, int h_in, int R) {
  const int guess = direct_slot(mode, ntable, item);
  int r = 0;
  i64 aoff = 0;
  if (guess >= 0) {  // loads in flight together with the segment bounds
    r = ranks[p * nslots + guess];
    aoff = a_off[p * nslots + guess];
  }
  wk.it = find_item(mode, table, ntable, rows, item, bm, nslots);
  if (wk.it.slot < 0) return false;
  if (wk.it.slot != guess) {
    r = ranks[p * nslots + wk.it.slot];
    aoff = a_off[p * nslots + wk.it.slot];
  }
  wk.r = r;
  wk.A = pool + aoff + (i64)layer * h_in * r;
  return r > 0 && r <= min(R, LORA_MAX_RANK);
}

// What one expand block works on: column tile `tile` of the launch falls in slice p; item
// `item` is rows [it.row0, it.row0 + it.nrows) of the adapter in it.slot, whose rank, B offset
// and scale for slice p are r, boff and scale.
struct ExpandWork {
  LoraItem it;
  int p, width, col, tile0;  // the slice: index, columns, first column in y, first column tile
  int r;
  i64 boff;
  float scale;
};

// The prologue the expand kernels share. Slice fields are read with compile-time indices (a
// runtime index into the kernel-argument struct would put it in local memory); a direct SGMV
// item's tables are read in parallel with its segment bounds. False: nothing to do (no adapter,
// or a rank outside [1, min(R, LORA_MAX_RANK)]).
__device__ __forceinline__ bool expand_work(ExpandWork& wk, const SliceTable& sl, int nslices, int tile, int item,
                                            int bm, int mode, const int* table, int ntable, int rows, int nslots,
                                            const int* ranks, const i64* b_off, const float* scales, int R) {
  wk.p = 0;
  wk.width = sl.width[0];
  wk.col = sl.col[0];
  wk.tile0 = 0;
#pragma unroll
  for (int q = 1; q < LORA_MAX_SLICES; ++q)
    if (q < nslices && tile >= sl.tile0[q]) {
      wk.p = q;
      wk.width = sl.width[q];
      wk.col = sl.col[q];
      wk.tile0 = sl.tile0[q];
    }
  const int guess = direct_slot(mode, ntable, item);
  const int base = wk.p * nslots;
  if (guess >= 0) {
    wk.r = ranks[base + guess];
    wk.boff = b_off[base + guess];
    wk.scale = scales[base + guess];
  }
  wk.it = find_item(mode, table, ntable, rows, item, bm, nslots);
  if (wk.it.slot < 0) return false;
  if (wk.it.slot != guess) {
    wk.r = ranks[base + wk.it.slot];
    wk.boff = b_off[base + wk.it.slot];
    wk.scale = scales[base + wk.it.slot];
  }
  return wk.r > 0 && wk.r <= min(R, LORA_MAX_RANK);
}

// Eight consecutive 16-bit values from global memory: one 16-byte load when `vec` (caller
// checked alignment) and all eight are in range, else element loads of the first `valid`
// values and zeros after (compile-time lanes: no local-memory array, no call).
__device__ __forceinline__ uint4 load8_slow(const u16* src, int valid) {
  u32 w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < valid) w[e >> 1] |= ((u32)src[e]) << ((e & 1) * 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 load8(const u16* src, bool vec, int valid) {
  if (vec && valid >= 8) return *(const uint4*)src;
  if (valid <= 0) return make_uint4(0, 0, 0, 0);
  return load8_slow(src, valid);
}

__device__ __forceinline__ u16 u4_get(const uint4& v, int e) {
  const u32 w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
  return (u16)((e & 1) ? (w >> 16) : (w & 0xffffu));
}

#define LORA_MAX_KSPLIT 16

// sum_j part[p][j][row][n] for j < ksplit (<= LORA_MAX_KSPLIT), in order j = 0, 1, ...;
// all loads independent (in flight together), read at L2 (other blocks wrote them).
__device__ __forceinline__ float sum_partials(const float* part, int p, int ksplit, int rows, int R,
                                              i64 row, int n) {
  const float* src = part + (((i64)p * ksplit) * rows + row) * R + n;
  const i64 step = (i64)rows * R;
  float v[LORA_MAX_KSPLIT];
#pragma unroll
  for (int j = 0; j < LORA_MAX_KSPLIT; ++j, src += step) v[j] = j < ksplit ? __ldcg(src) : 0.f;  // one add per load
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < LORA_MAX_KSPLIT; ++j) s += v[j];
  return s;
}
