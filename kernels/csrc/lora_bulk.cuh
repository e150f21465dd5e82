// TMA tensor copies and mbarriers (sm_90+, inline PTX): one instruction copies a box of a tensor
// that a tensor map describes into shared memory, and its bytes count down the transaction count
// of an mbarrier in shared memory; threads wait on the barrier's phase. The prefill shrink streams
// its x tiles this way: one thread issues a copy a stage, where cp.async needs every thread's
// index math for every 16 bytes.
#pragma once
#include "lora_common.cuh"

// A CUtensorMap (cuda.h), made on the host (kernels/cuda/_tensor_map.py) and passed by value as a
// __grid_constant__ kernel parameter: the copy engine reads it there.
struct __align__(64) LoraTensorMap {
  unsigned long long opaque[16];
};

#if __CUDA_ARCH__ >= 900
#define LORA_HAVE_BULK 1

__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// After the inits, before any other thread or the copy engine uses the barriers (then a barrier).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// This thread's arrival, with `bytes` more to come from copies in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Until the phase of parity `parity` has completed (the first phase is parity 0).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}

// The box at (c0 inner, c1 outer) of the 2-D tensor `map` describes into shared dst (aligned as the
// map's swizzle needs: 1024 bytes for 128-byte swizzle), counted on `bar`: the whole box's bytes,
// elements outside the tensor filled with zeros.
__device__ __forceinline__ void tma_load_2d(u32 dst, const LoraTensorMap& map, int c0, int c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The tensor map into the cache its copies read it from: issued at a block's start, the fetch of its
// 128 bytes overlaps the block's table lookups instead of delaying the first copy.
__device__ __forceinline__ void tma_prefetch_map(const LoraTensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&map)) : "memory");
}

// Orders this thread's earlier shared-memory accesses before its later bulk copies (a buffer
// that was read is refilled).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#else
#define LORA_HAVE_BULK 0
#endif
