// SGMV / BGMV shrink kernels (the body and its description: lora_shrink.cuh).
#include "lora_shrink.cuh"

#define LORA_SHRINK_KERNEL(NAME, DT, BM, NTM)                                                 \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS) NAME(                            \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,        \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, u16* ws,       \
      i64 ws_pstride, int R, float* part, int* counters, int ksplit, int kc, int items,       \
      int mode) {                                                                             \
    __shared__ __align__(16) unsigned char smem[ShrinkShape<BM>::SMEM];                       \
    shrink_body<DT, BM, NTM>(blockIdx.x, blockIdx.y, blockIdx.z, smem, x, x_stride, pool,     \
                             a_off, ranks, table, ntable, nslots, rows, h_in, layer, ws,      \
                             ws_pstride, R, part, counters, ksplit, kc, items, mode);         \
  }

// Prefill (64-row items): the rank chunk width by rank cap. (Decode: lora_shrink_dec.cu.)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r32, 0, 64, 4)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r64, 0, 64, 8)
LORA_SHRINK_KERNEL(lora_shrink_bf16_m64_r128, 0, 64, 16)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r32, 1, 64, 4)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r64, 1, 64, 8)
LORA_SHRINK_KERNEL(lora_shrink_fp16_m64_r128, 1, 64, 16)
