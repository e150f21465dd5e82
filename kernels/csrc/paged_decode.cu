// Decode attention over the paged KV cache: one query row per sequence, split-K over the
// context ("flash decoding"), GQA aware.
//
// Cache of one layer: K and V each [num_blocks, block_size, Hkv, D], token t of sequence b
// at slot block_tables[b][t / block_size] * block_size + t % block_size. Query row
// q_rows[b] of q [T, Hq, D] attends to tokens [0, context_lens[b]) of sequence b.
//
// paged_decode<DT, D, G>: grid (B, Hkv, num_splits), PD_THREADS threads. One block serves
// the G = Hq / Hkv query heads that share kv head blockIdx.y, over PD_SPLIT tokens of the
// context, so every K/V byte is read once. A token's D elements are spread over TG lanes
// with 16-byte loads (4 tokens in flight per lane). The block writes, per query
// head, its running max m, its sum l of exp(s - m) and its unnormalised output o (fp32).
// paged_decode_combine<DT>: grid (B, Hq), D threads: out = sum_s e^(m_s-M) o_s / sum_s
// e^(m_s-M) l_s. A sequence with context 0 (a padded CUDA-graph row) gets zeros.
//
// DT = 0: bfloat16, 1: float16, 2: float32. Compiled per (DT, D, G) by NVRTC (CuPy
// name_expressions); nvcc -DPD_INSTANTIATE_FOR_TEST instantiates a few for the PTX test.
#include "lora_common.cuh"

#define PD_THREADS 128
#define PD_SPLIT 256
#define PD_NEG_INF (-__int_as_float(0x7f800000))

template <int DT> struct PdElem { static constexpr int bytes = 2; };
template <> struct PdElem<2> { static constexpr int bytes = 4; };

// 16 bytes at p -> 16 / bytes floats.
template <int DT> __device__ __forceinline__ void pd_load(const char* p, float* out) {
  const uint4 r = *(const uint4*)p;
  const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = to_f32<DT>((u16)(w[i] & 0xffff));
    out[2 * i + 1] = to_f32<DT>((u16)(w[i] >> 16));
  }
}
template <> __device__ __forceinline__ void pd_load<2>(const char* p, float* out) {
  const float4 r = *(const float4*)p;
  out[0] = r.x; out[1] = r.y; out[2] = r.z; out[3] = r.w;
}

template <int DT> __device__ __forceinline__ void pd_store(char* p, float v) { *(u16*)p = from_f32<DT>(v); }
template <> __device__ __forceinline__ void pd_store<2>(char* p, float v) { *(float*)p = v; }

__device__ __forceinline__ float pd_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float pd_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int DT, int D, int G>
__global__ void __launch_bounds__(PD_THREADS) paged_decode(
    const char* __restrict__ q, long long q_row_stride, const int* __restrict__ q_rows,
    const char* __restrict__ k_cache, const char* __restrict__ v_cache, int num_kv_heads, int block_size,
    const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ context_lens,
    float scale, float* __restrict__ part_out, float* __restrict__ part_ml, int num_splits) {
  constexpr int ES = PdElem<DT>::bytes;
  constexpr int VEC = 16 / ES;            // elements per lane per token
  constexpr int TG = D / VEC;             // lanes per token
  constexpr int NG = PD_THREADS / TG;     // tokens per pass
  constexpr int NW = PD_THREADS / 32;
  constexpr int PD_UNROLL = 4;  // tokens in flight per lane (8 measured slower: 5.9 vs 3.5 ms per 7B step)
  static_assert(D % VEC == 0 && TG >= 1 && TG <= 32 && (TG & (TG - 1)) == 0, "unsupported head_dim");
  __shared__ float s_p[G][PD_SPLIT];
  __shared__ float s_red[NG][G][D];
  __shared__ float s_stat[G][NW];

  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int hq0 = h * G, num_q_heads = num_kv_heads * G;
  const int ctx = context_lens[b];
  const int t0 = split * PD_SPLIT, t1 = min(ctx, t0 + PD_SPLIT);
  const long long part = ((long long)b * num_q_heads + hq0) * num_splits + split;  // of head g: + g * num_splits
  const int tid = threadIdx.x, lane = tid % TG, grp = tid / TG, warp = tid / 32;
  if (t0 >= t1) {
    if (tid < G) {
      part_ml[(part + (long long)tid * num_splits) * 2] = PD_NEG_INF;
      part_ml[(part + (long long)tid * num_splits) * 2 + 1] = 0.f;
    }
    return;
  }

  float qv[G][VEC];
  const char* qp = q + ((long long)q_rows[b] * q_row_stride + (long long)hq0 * D + lane * VEC) * ES;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    pd_load<DT>(qp + (long long)g * D * ES, qv[g]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[g][i] *= scale;
  }
  const int* table = block_tables + (long long)b * bt_stride;
  const long long tok_stride = (long long)num_kv_heads * D * ES;  // bytes between slots
  const long long head_off = ((long long)h * D + lane * VEC) * ES;

  // Scores s = q . k (scaled), kept in shared memory; per-lane running max.
  float mx[G];
#pragma unroll
  for (int g = 0; g < G; ++g) mx[g] = PD_NEG_INF;
  for (int it = t0; it < t1; it += NG * PD_UNROLL) {  // warp-uniform trip count (shuffles inside)
    float kv[PD_UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < PD_UNROLL; ++u) {
      const int t = it + grp + u * NG;
      if (t < t1) {
        const long long slot = (long long)table[t / block_size] * block_size + t % block_size;
        pd_load<DT>(k_cache + slot * tok_stride + head_off, kv[u]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) kv[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < PD_UNROLL; ++u) {
      const int t = it + grp + u * NG;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) d += qv[g][i] * kv[u][i];
#pragma unroll
        for (int o = TG / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (t < t1) {
          if (lane == 0) s_p[g][t - t0] = d;
          mx[g] = fmaxf(mx[g], d);
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float m = pd_warp_max(mx[g]);
    if (tid % 32 == 0) s_stat[g][warp] = m;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float m = s_stat[g][0];
#pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, s_stat[g][w]);
    mx[g] = m;
  }
  __syncthreads();  // s_stat is reused for the sums

  // p = exp(s - m) in place, and its sum.
  float sum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) sum[g] = 0.f;
  for (int i = tid; i < t1 - t0; i += PD_THREADS) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float p = __expf(s_p[g][i] - mx[g]);
      s_p[g][i] = p;
      sum[g] += p;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float s = pd_warp_sum(sum[g]);
    if (tid % 32 == 0) s_stat[g][warp] = s;
  }
  __syncthreads();

  // o = sum_t p_t v_t: each token group over its tokens, then across groups.
  float acc[G][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  for (int it = t0; it < t1; it += NG * PD_UNROLL) {
    float vv[PD_UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < PD_UNROLL; ++u) {
      const int t = it + grp + u * NG;
      if (t < t1) {
        const long long slot = (long long)table[t / block_size] * block_size + t % block_size;
        pd_load<DT>(v_cache + slot * tok_stride + head_off, vv[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < PD_UNROLL; ++u) {
      const int t = it + grp + u * NG;
      if (t < t1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = s_p[g][t - t0];
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[g][i] += p * vv[u][i];
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < VEC; ++i) s_red[grp][g][lane * VEC + i] = acc[g][i];
  __syncthreads();
  for (int j = tid; j < G * D; j += PD_THREADS) {
    const int g = j / D, d = j % D;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < NG; ++r) o += s_red[r][g][d];
    part_out[(part + (long long)g * num_splits) * D + d] = o;
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {  // static indices: mx stays in registers
    if (tid == g) {
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) l += s_stat[g][w];
      part_ml[(part + (long long)g * num_splits) * 2] = mx[g];
      part_ml[(part + (long long)g * num_splits) * 2 + 1] = l;
    }
  }
}

template <int DT>
__global__ void paged_decode_combine(
    const float* __restrict__ part_out, const float* __restrict__ part_ml, int num_splits,
    const int* __restrict__ context_lens, const int* __restrict__ q_rows, char* __restrict__ out,
    long long out_row_stride, int head_dim) {
  constexpr int ES = PdElem<DT>::bytes;
  const int b = blockIdx.x, hq = blockIdx.y, num_q_heads = gridDim.y, d = threadIdx.x;
  const int used = min(num_splits, (context_lens[b] + PD_SPLIT - 1) / PD_SPLIT);
  const long long base = ((long long)b * num_q_heads + hq) * num_splits;
  float m = PD_NEG_INF;
  for (int s = 0; s < used; ++s) m = fmaxf(m, part_ml[(base + s) * 2]);
  float l = 0.f, o = 0.f;
  for (int s = 0; s < used; ++s) {
    const float w = __expf(part_ml[(base + s) * 2] - m);
    l += w * part_ml[(base + s) * 2 + 1];
    o += w * part_out[(base + s) * head_dim + d];
  }
  const float r = l > 0.f ? o / l : 0.f;
  pd_store<DT>(out + ((long long)q_rows[b] * out_row_stride + (long long)hq * head_dim + d) * ES, r);
}

#ifdef PD_INSTANTIATE_FOR_TEST
template __global__ void paged_decode<0, 128, 1>(const char*, long long, const int*, const char*, const char*, int, int,
                                                 const int*, int, const int*, float, float*, float*, int);
template __global__ void paged_decode<1, 64, 3>(const char*, long long, const int*, const char*, const char*, int, int,
                                                const int*, int, const int*, float, float*, float*, int);
template __global__ void paged_decode<2, 64, 4>(const char*, long long, const int*, const char*, const char*, int, int,
                                                const int*, int, const int*, float, float*, float*, int);
template __global__ void paged_decode_combine<0>(const float*, const float*, int, const int*, const int*, char*,
                                                 long long, int);
#endif
