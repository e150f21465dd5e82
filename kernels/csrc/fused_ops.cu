// Fused element-wise kernels of the decoder layer (bf16/fp16), one launch where the
// PyTorch expression takes several. Each rounds to the storage dtype exactly where the
// PyTorch reference (kernels/fused_ops.py) does, so both compute the same function:
//
// add_rms_norm<DT>:  x = bf16(x + delta) (in place, when delta is given);
//                    out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))      grid T, FO_THREADS
// rope_cache<DT>:    q, k of a fused qkv row rotated (cos/sin rounded to DT, rotate_half),
//                    q to q_out [T, Hq, D], k and v to the KV cache at slot_mapping[t]
//                                                          grid (T, pair blocks + v blocks)
// silu_mul<DT>:      out = bf16(bf16(silu(gate)) * up) of a fused [gate | up] row
//
// DT = 0: bfloat16, 1: float16.
#include "lora_common.cuh"

#define FO_THREADS 256

template <int DT> __device__ __forceinline__ float rnd(float v) { return to_f32<DT>(from_f32<DT>(v)); }

// add_rms_norm keeps a row in registers, 8 values per 16-byte vector: rows up to this many
// vectors per thread take the vector path (hidden <= 8 * FO_THREADS * NORM_VPT = 8192).
#define NORM_VPT 4

__device__ __forceinline__ bool aligned16(const void* p) { return (((unsigned long long)p) & 15) == 0; }

template <int DT> __device__ __forceinline__ float u4_f32(const uint4& v, int e) { return to_f32<DT>(u4_get(v, e)); }

template <int DT> __device__ __forceinline__ uint4 pack8(const float* f) {
  u32 w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = (u32)from_f32<DT>(f[2 * e]) | ((u32)from_f32<DT>(f[2 * e + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float s_sum[FO_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) s_sum[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < FO_THREADS / 32; ++w) total += s_sum[w];
  return total;
}

// Every load of the row (x, delta, weight) is issued before the first use: one memory round
// trip per row instead of one per strided step.
template <int DT>
__device__ __forceinline__ void add_rms_norm_vec(u16* xr, const u16* dr, const u16* weight, u16* orow, int hidden,
                                                 float eps) {
  const int nv = hidden / 8, tid = threadIdx.x;
  uint4 xv[NORM_VPT], dv[NORM_VPT], wv[NORM_VPT];
#pragma unroll
  for (int u = 0; u < NORM_VPT; ++u) {
    const int i = tid + u * FO_THREADS;
    if (i < nv) {
      xv[u] = *(const uint4*)(xr + 8 * i);
      dv[u] = dr ? *(const uint4*)(dr + 8 * i) : make_uint4(0, 0, 0, 0);
      wv[u] = *(const uint4*)(weight + 8 * i);
    }
  }
  float v[NORM_VPT][8], sum = 0.f;
#pragma unroll
  for (int u = 0; u < NORM_VPT; ++u) {
    if (tid + u * FO_THREADS < nv) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[u][e] = dr ? rnd<DT>(u4_f32<DT>(xv[u], e) + u4_f32<DT>(dv[u], e)) : u4_f32<DT>(xv[u], e);
        sum += v[u][e] * v[u][e];
      }
      if (dr) *(uint4*)(xr + 8 * (tid + u * FO_THREADS)) = pack8<DT>(v[u]);
    }
  }
  const float r = rsqrtf(block_sum(sum) / hidden + eps);
#pragma unroll
  for (int u = 0; u < NORM_VPT; ++u) {
    if (tid + u * FO_THREADS < nv) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = u4_f32<DT>(wv[u], e) * rnd<DT>(v[u][e] * r);
      *(uint4*)(orow + 8 * (tid + u * FO_THREADS)) = pack8<DT>(o);
    }
  }
}

template <int DT>
__device__ __forceinline__ void add_rms_norm_scalar(u16* xr, const u16* dr, const u16* weight, u16* orow, int hidden,
                                                    float eps) {
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += FO_THREADS) {
    float v = to_f32<DT>(xr[i]);
    if (dr) {
      v = rnd<DT>(v + to_f32<DT>(dr[i]));
      xr[i] = from_f32<DT>(v);
    }
    sum += v * v;
  }
  const float r = rsqrtf(block_sum(sum) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += FO_THREADS) {  // same thread reads what it wrote
    orow[i] = from_f32<DT>(to_f32<DT>(weight[i]) * rnd<DT>(to_f32<DT>(xr[i]) * r));
  }
}

template <int DT>
__global__ void __launch_bounds__(FO_THREADS) add_rms_norm(
    u16* __restrict__ x, long long x_stride, const u16* __restrict__ delta, long long delta_stride,
    const u16* __restrict__ weight, u16* __restrict__ out, long long out_stride, int hidden, float eps) {
  const long long row = blockIdx.x;
  u16* xr = x + row * x_stride;
  const u16* dr = delta ? delta + row * delta_stride : nullptr;
  u16* orow = out + row * out_stride;
  const bool vec = hidden % 8 == 0 && hidden <= 8 * FO_THREADS * NORM_VPT && aligned16(xr) && aligned16(weight) &&
                   aligned16(orow) && (dr == nullptr || aligned16(dr));
  if (vec)
    add_rms_norm_vec<DT>(xr, dr, weight, orow, hidden, eps);
  else
    add_rms_norm_scalar<DT>(xr, dr, weight, orow, hidden, eps);
}

// Grid (T, pair blocks + v blocks): blocks y < pair_blocks rotate one (d, d + D/2) pair of a
// q or k head per thread; the rest copy v, 8 values per thread. One memory round trip each.
template <int DT>
__global__ void __launch_bounds__(FO_THREADS) rope_cache(
    const u16* __restrict__ qkv, long long qkv_stride, const long long* __restrict__ positions,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const long long* __restrict__ slots,
    u16* __restrict__ q_out, u16* __restrict__ k_cache, u16* __restrict__ v_cache, int num_heads,
    int num_kv_heads, int head_dim, int pair_blocks) {
  const long long t = blockIdx.x;
  const int half = head_dim / 2;
  const u16* row = qkv + t * qkv_stride;
  const long long slot = slots[t];
  const int kv_size = num_kv_heads * head_dim, q_size = num_heads * head_dim;
  if ((int)blockIdx.y >= pair_blocks) {  // v: row[q + kv ..] -> v_cache[slot]
    const int j0 = 8 * (((int)blockIdx.y - pair_blocks) * FO_THREADS + threadIdx.x);
    if (j0 >= kv_size) return;
    const u16* src = row + q_size + kv_size + j0;
    u16* dst = v_cache + slot * kv_size + j0;
    if (j0 + 8 <= kv_size && aligned16(src) && aligned16(dst)) {
      *(uint4*)dst = *(const uint4*)src;
    } else {
      for (int e = 0; e < 8 && j0 + e < kv_size; ++e) dst[e] = src[e];
    }
    return;
  }
  const int j = blockIdx.y * FO_THREADS + threadIdx.x;
  if (j >= (num_heads + num_kv_heads) * half) return;
  const long long pos = positions[t];
  const float* cr = cos_t + pos * head_dim;
  const float* sr = sin_t + pos * head_dim;
  const int head = j / half, d = j % half;
  const int col = head * head_dim + d;  // q heads then k heads, as in the fused row
  const float x1 = to_f32<DT>(row[col]), x2 = to_f32<DT>(row[col + half]);
  const float c1 = rnd<DT>(cr[d]), s1 = rnd<DT>(sr[d]);
  const float c2 = rnd<DT>(cr[d + half]), s2 = rnd<DT>(sr[d + half]);
  const u16 lo = from_f32<DT>(rnd<DT>(x1 * c1) - rnd<DT>(x2 * s1));
  const u16 hi = from_f32<DT>(rnd<DT>(x2 * c2) + rnd<DT>(x1 * s2));
  u16* dst = head < num_heads ? q_out + t * q_size + col : k_cache + slot * kv_size + (col - q_size);
  dst[0] = lo;
  dst[half] = hi;
}

template <int DT>
__global__ void __launch_bounds__(FO_THREADS) silu_mul(
    const u16* __restrict__ gate_up, long long in_stride, u16* __restrict__ out, long long out_stride, int width) {
  const long long t = blockIdx.y;
  const int i = blockIdx.x * FO_THREADS + threadIdx.x;
  if (i >= width) return;
  const float g = to_f32<DT>(gate_up[t * in_stride + i]), u = to_f32<DT>(gate_up[t * in_stride + width + i]);
  out[t * out_stride + i] = from_f32<DT>(rnd<DT>(g / (1.f + __expf(-g))) * u);
}

#ifdef PD_INSTANTIATE_FOR_TEST
template __global__ void add_rms_norm<0>(u16*, long long, const u16*, long long, const u16*, u16*, long long, int, float);
template __global__ void rope_cache<1>(const u16*, long long, const long long*, const float*, const float*,
                                       const long long*, u16*, u16*, u16*, int, int, int, int);
template __global__ void silu_mul<0>(const u16*, long long, u16*, long long, int);
#endif
