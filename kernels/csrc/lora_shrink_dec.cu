// Decode shrink kernels on CUDA cores (the body and its description: lora_shrink_dec.cuh).
#include "lora_shrink_dec.cuh"

#define LORA_SHRINK_DEC_KERNEL(NAME, DT, PDL)                                                           \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS, 4) NAME(                                   \
      const u16* x, i64 x_stride, const u16* pool, const i64* a_off, const int* ranks,                  \
      const int* table, int ntable, int nslots, int rows, int h_in, int layer, int R, float* part,      \
      int ksplit, int kc, int mode) {                                                                   \
    __shared__ float red[SHRINK_DEC_RED];                                                               \
    shrink_dec_body<DT, PDL>(blockIdx.x, blockIdx.y, blockIdx.z, red, x, x_stride, pool, a_off, ranks,  \
                             table, ntable, nslots, rows, h_in, layer, R, part, ksplit, kc, mode);      \
  }

LORA_SHRINK_DEC_KERNEL(lora_shrink_dec_bf16_m4, 0, false)
LORA_SHRINK_DEC_KERNEL(lora_shrink_dec_fp16_m4, 1, false)
// The same, for a launch whose expand follows as its programmatic dependent: a kernel of its own so
// that its shared-memory carveout (kernels/cuda/_launch.py, SHRINK_PDL_CARVEOUT) is its own.
LORA_SHRINK_DEC_KERNEL(lora_shrink_dec_bf16_m4_pdl, 0, true)
LORA_SHRINK_DEC_KERNEL(lora_shrink_dec_fp16_m4_pdl, 1, true)
