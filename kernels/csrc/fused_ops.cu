// Fused element-wise kernels of the decoder layer (bf16/fp16), one launch where the
// PyTorch expression takes several. Each rounds to the storage dtype exactly where the
// PyTorch reference (kernels/fused_ops.py) does, so both compute the same function:
//
// add_rms_norm<DT>:  x = bf16(x + delta) (in place, when delta is given);
//                    out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))      grid T, FO_THREADS
// rope_cache<DT>:    q, k of a fused qkv row rotated (cos/sin rounded to DT, rotate_half),
//                    q to q_out [T, Hq, D], k and v to the KV cache at slot_mapping[t]
// silu_mul<DT>:      out = bf16(bf16(silu(gate)) * up) of a fused [gate | up] row
//
// DT = 0: bfloat16, 1: float16.
#include "lora_common.cuh"

#define FO_THREADS 256

template <int DT> __device__ __forceinline__ float rnd(float v) { return to_f32<DT>(from_f32<DT>(v)); }

template <int DT>
__global__ void __launch_bounds__(FO_THREADS) add_rms_norm(
    u16* __restrict__ x, long long x_stride, const u16* __restrict__ delta, long long delta_stride,
    const u16* __restrict__ weight, u16* __restrict__ out, long long out_stride, int hidden, float eps) {
  __shared__ float s_sum[FO_THREADS / 32];
  const long long row = blockIdx.x;
  u16* xr = x + row * x_stride;
  const u16* dr = delta ? delta + row * delta_stride : nullptr;
  float sum = 0.f;
  for (int i = threadIdx.x; i < hidden; i += FO_THREADS) {
    float v = to_f32<DT>(xr[i]);
    if (dr) {
      v = rnd<DT>(v + to_f32<DT>(dr[i]));
      xr[i] = from_f32<DT>(v);
    }
    sum += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) s_sum[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < FO_THREADS / 32; ++w) total += s_sum[w];
  const float r = rsqrtf(total / hidden + eps);
  u16* orow = out + row * out_stride;
  for (int i = threadIdx.x; i < hidden; i += FO_THREADS) {  // same thread reads what it wrote
    orow[i] = from_f32<DT>(to_f32<DT>(weight[i]) * rnd<DT>(to_f32<DT>(xr[i]) * r));
  }
}

template <int DT>
__global__ void __launch_bounds__(FO_THREADS) rope_cache(
    const u16* __restrict__ qkv, long long qkv_stride, const long long* __restrict__ positions,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const long long* __restrict__ slots,
    u16* __restrict__ q_out, u16* __restrict__ k_cache, u16* __restrict__ v_cache, int num_heads,
    int num_kv_heads, int head_dim) {
  const long long t = blockIdx.x;
  const int half = head_dim / 2;
  const u16* row = qkv + t * qkv_stride;
  const long long pos = positions[t], slot = slots[t];
  const float* cr = cos_t + pos * head_dim;
  const float* sr = sin_t + pos * head_dim;
  const int kv_size = num_kv_heads * head_dim, q_size = num_heads * head_dim;
  for (int j = threadIdx.x; j < (num_heads + num_kv_heads) * half; j += FO_THREADS) {
    const int head = j / half, d = j % half;
    const int col = head * head_dim + d;  // q heads then k heads, as in the fused row
    const float x1 = to_f32<DT>(row[col]), x2 = to_f32<DT>(row[col + half]);
    const float c1 = rnd<DT>(cr[d]), s1 = rnd<DT>(sr[d]);
    const float c2 = rnd<DT>(cr[d + half]), s2 = rnd<DT>(sr[d + half]);
    const u16 lo = from_f32<DT>(rnd<DT>(x1 * c1) - rnd<DT>(x2 * s1));
    const u16 hi = from_f32<DT>(rnd<DT>(x2 * c2) + rnd<DT>(x1 * s2));
    u16* dst = head < num_heads ? q_out + t * q_size + col
                                : k_cache + slot * kv_size + (col - q_size);
    dst[0] = lo;
    dst[half] = hi;
  }
  for (int j = threadIdx.x; j < kv_size; j += FO_THREADS) v_cache[slot * kv_size + j] = row[q_size + kv_size + j];
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
                                       const long long*, u16*, u16*, u16*, int, int, int);
template __global__ void silu_mul<0>(const u16*, long long, u16*, long long, int);
#endif
