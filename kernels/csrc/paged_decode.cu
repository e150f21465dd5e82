// Decode attention over the paged KV cache: one query row per sequence, split-K over the
// context ("flash decoding"), GQA aware.
//
// Cache of one layer: K and V each [num_blocks, block_size, Hkv, D], token t of sequence b
// at slot block_tables[b][t / block_size] * block_size + t % block_size. Query row
// q_rows[b] of q [T, Hq, D] attends to tokens [0, context_lens[b]) of sequence b, or with a
// sliding window W > 0 to its last W tokens [context_lens[b] - W, context_lens[b]) (the splits
// before them write an empty partial). softcap > 0 caps each score s (already scaled) to
// softcap * tanh(s / softcap) before the softmax (Gemma 2); 0 leaves it as it is.
//
// paged_decode<DT, D, G, U>: grid (B, Hkv, num_splits), PD_THREADS threads. One block serves
// the G = Hq / Hkv query heads that share kv head blockIdx.y, over PD_SPLIT tokens of the
// context, so every K/V byte is read once, K and V in the same pass (online softmax). A
// token's D elements are spread over TG lanes with 16-byte loads, U tokens in flight per
// lane. The block writes, per query head, its max m, its sum l of exp(s - m) and its
// unnormalised output o (fp32).
// paged_decode_combine<DT>: grid (B, Hq), D threads: out = sum_s e^(m_s-M) o_s / sum_s
// e^(m_s-M) l_s. A sequence with context 0 (a padded CUDA-graph row) gets zeros.
//
// DT = 0: bfloat16, 1: float16, 2: float32. Compiled per (DT, D, G, U) by NVRTC (CuPy
// name_expressions); nvcc -DPD_INSTANTIATE_FOR_TEST instantiates a few for the PTX test.
#include "lora_common.cuh"

#define PD_THREADS 128
#define PD_SPLIT 256
#define PD_NEG_INF (-__int_as_float(0x7f800000))

template <int DT> struct PdElem { static constexpr int bytes = 2; };
template <> struct PdElem<2> { static constexpr int bytes = 4; };

// 16 loaded bytes -> 16 / bytes floats.
template <int DT> __device__ __forceinline__ void pd_unpack(const uint4& r, float* out) {
  const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = to_f32<DT>((u16)(w[i] & 0xffff));
    out[2 * i + 1] = to_f32<DT>((u16)(w[i] >> 16));
  }
}
template <> __device__ __forceinline__ void pd_unpack<2>(const uint4& r, float* out) {
  out[0] = __uint_as_float(r.x); out[1] = __uint_as_float(r.y);
  out[2] = __uint_as_float(r.z); out[3] = __uint_as_float(r.w);
}

template <int DT> __device__ __forceinline__ void pd_store(char* p, float v) { *(u16*)p = from_f32<DT>(v); }
template <> __device__ __forceinline__ void pd_store<2>(char* p, float v) { *(float*)p = v; }

// The slot of token t of a sequence (its block table), or -1 past t1.
__device__ __forceinline__ long long pd_slot(const int* table, int t, int t1, int block_size) {
  return t < t1 ? (long long)table[t / block_size] * block_size + t % block_size : -1;
}

// One pass over the split with an online softmax per token group: each lane group of TG
// lanes walks its own tokens (grp, grp + NG, ...) keeping a running max m, sum l and output
// acc, with U tokens' K and V rows in flight per lane (2U 16-byte loads) and the next
// iteration's block-table slots loaded under them. No block-wide barrier until the end,
// where the NG groups' (m, l, acc) are merged through shared memory.
template <int DT, int D, int G, int U>
__global__ void __launch_bounds__(PD_THREADS) paged_decode(
    const char* __restrict__ q, long long q_row_stride, const int* __restrict__ q_rows,
    const char* __restrict__ k_cache, const char* __restrict__ v_cache, int num_kv_heads, int block_size,
    const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ context_lens,
    float scale, int window, float softcap, float* __restrict__ part_out, float* __restrict__ part_ml,
    int num_splits) {
  constexpr int ES = PdElem<DT>::bytes;
  constexpr int VEC = 16 / ES;            // elements per lane per token
  constexpr int TG = D / VEC;             // lanes per token
  constexpr int NG = PD_THREADS / TG;     // token groups (tokens per pass)
  static_assert(D % VEC == 0 && TG >= 1 && TG <= 32 && (TG & (TG - 1)) == 0, "unsupported head_dim");
  __shared__ float s_acc[NG][G][D];
  __shared__ float s_ml[NG][G][2];

  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int hq0 = h * G, num_q_heads = num_kv_heads * G;
  const int ctx = context_lens[b];
  const int t0 = max(split * PD_SPLIT, window > 0 ? ctx - window : 0), t1 = min(ctx, split * PD_SPLIT + PD_SPLIT);
  const long long part = ((long long)b * num_q_heads + hq0) * num_splits + split;  // of head g: + g * num_splits
  const int tid = threadIdx.x, lane = tid % TG, grp = tid / TG;
  if (t0 >= t1) {
    if (tid < G) {
      part_ml[(part + (long long)tid * num_splits) * 2] = PD_NEG_INF;
      part_ml[(part + (long long)tid * num_splits) * 2 + 1] = 0.f;
    }
    return;
  }

  const int* table = block_tables + (long long)b * bt_stride;
  long long slot[U];
#pragma unroll
  for (int u = 0; u < U; ++u) slot[u] = pd_slot(table, t0 + grp + u * NG, t1, block_size);
  float qv[G][VEC];
  const char* qp = q + ((long long)q_rows[b] * q_row_stride + (long long)hq0 * D + lane * VEC) * ES;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    pd_unpack<DT>(*(const uint4*)(qp + (long long)g * D * ES), qv[g]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[g][i] *= scale;
  }
  const long long tok_stride = (long long)num_kv_heads * D * ES;  // bytes between slots
  const long long head_off = ((long long)h * D + lane * VEC) * ES;

  float m[G], l[G], acc[G][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = PD_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }
  for (int it = t0; it < t1; it += NG * U) {  // block-uniform trip count (shuffles inside)
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (slot[u] >= 0) {
        kr[u] = *(const uint4*)(k_cache + slot[u] * tok_stride + head_off);
        vr[u] = *(const uint4*)(v_cache + slot[u] * tok_stride + head_off);
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = slot[u] >= 0;
      slot[u] = pd_slot(table, it + NG * U + grp + u * NG, t1, block_size);  // next pass, under the loads
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      pd_unpack<DT>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) d += qv[g][i] * kf[i];
#pragma unroll
        for (int o = TG / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (softcap > 0.f) d = softcap * tanhf(d / softcap);
        s[u][g] = valid[u] ? d : PD_NEG_INF;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mn = fmaxf(mn, s[u][g]);
      if (mn == PD_NEG_INF) continue;  // no token of this group yet
      const float corr = __expf(m[g] - mn);
      m[g] = mn;
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[g][i] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = __expf(s[u][g] - mn);
        l[g] += p;
        float vf[VEC];
        pd_unpack<DT>(vr[u], vf);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
  }

  // Merge the NG groups: M = max m_r, o = sum_r e^(m_r - M) acc_r, l = sum_r e^(m_r - M) l_r.
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) s_acc[grp][g][lane * VEC + i] = acc[g][i];
    if (lane == 0) {
      s_ml[grp][g][0] = m[g];
      s_ml[grp][g][1] = l[g];
    }
  }
  __syncthreads();
  for (int j = tid; j < G * D; j += PD_THREADS) {
    const int g = j / D, d = j % D;
    float mx = PD_NEG_INF;
#pragma unroll
    for (int r = 0; r < NG; ++r) mx = fmaxf(mx, s_ml[r][g][0]);
    float o = 0.f, sum = 0.f;
#pragma unroll
    for (int r = 0; r < NG; ++r) {
      const float w = __expf(s_ml[r][g][0] - mx);  // 0 for a group without tokens (m = -inf)
      o = fmaf(w, s_acc[r][g][d], o);
      sum = fmaf(w, s_ml[r][g][1], sum);
    }
    part_out[(part + (long long)g * num_splits) * D + d] = o;
    if (d == 0) {
      part_ml[(part + (long long)g * num_splits) * 2] = mx;
      part_ml[(part + (long long)g * num_splits) * 2 + 1] = sum;
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
    const float ms = part_ml[(base + s) * 2];
    if (ms == PD_NEG_INF) continue;  // a split before a sliding window: its output was never written
    const float w = __expf(ms - m);
    l += w * part_ml[(base + s) * 2 + 1];
    o += w * part_out[(base + s) * head_dim + d];
  }
  const float r = l > 0.f ? o / l : 0.f;
  pd_store<DT>(out + ((long long)q_rows[b] * out_row_stride + (long long)hq * head_dim + d) * ES, r);
}

#ifdef PD_INSTANTIATE_FOR_TEST
template __global__ void paged_decode<0, 128, 1, 4>(const char*, long long, const int*, const char*, const char*, int, int,
                                                 const int*, int, const int*, float, int, float, float*, float*, int);
template __global__ void paged_decode<1, 64, 3, 2>(const char*, long long, const int*, const char*, const char*, int, int,
                                                const int*, int, const int*, float, int, float, float*, float*, int);
template __global__ void paged_decode<2, 64, 4, 2>(const char*, long long, const int*, const char*, const char*, int, int,
                                                const int*, int, const int*, float, int, float, float*, float*, int);
template __global__ void paged_decode<0, 256, 4, 2>(const char*, long long, const int*, const char*, const char*, int, int,
                                                 const int*, int, const int*, float, int, float, float*, float*, int);
template __global__ void paged_decode_combine<0>(const float*, const float*, int, const int*, const int*, char*,
                                                 long long, int);
#endif
