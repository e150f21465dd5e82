// Thread-block clusters (sm_90+, inline PTX): the blocks of one cluster run at once on one GPC
// and read each other's shared memory (distributed shared memory). The prefill shrink's split-K
// blocks form a cluster and sum their partial products there, not through global memory.
#pragma once
#include "lora_common.cuh"

#define LORA_MAX_CLUSTER 8  // blocks a cluster at most (the portable size; MAX_CLUSTER in kernels/cuda/_plan.py)

#if __CUDA_ARCH__ >= 900
#define LORA_HAVE_CLUSTERS 1

// Every thread of every block of the cluster arrives; shared-memory writes before it are visible
// to the cluster's reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address, in the cluster's shared window, of the shared address `addr` of block `rank`.
__device__ __forceinline__ u32 cluster_map(u32 addr, int rank) {
  u32 out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ float4 cluster_load4(u32 addr) {  // addr from cluster_map, 16-byte aligned
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
#else
#define LORA_HAVE_CLUSTERS 0
#endif

#if LORA_HAVE_CLUSTERS
__device__ __forceinline__ int cluster_blocks() {  // blocks in this block's cluster
  u32 n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return (int)n;
}
#endif

// Ends the kernel with an error (the launch fails: cudaErrorLaunchFailure): for a launch whose
// configuration contradicts the kernel's, which no result could survive.
__device__ __forceinline__ void launch_error() { asm volatile("trap;"); }

// Bytes of dynamic shared memory this launch gave the block.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
  u32 n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
