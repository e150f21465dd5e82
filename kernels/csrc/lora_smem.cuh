// Shared-memory staging for the LoRA kernels: asynchronous global -> shared copies (cp.async,
// sm_80+) and the ldmatrix loads of mma.sync m16n8k16 fragments (inline PTX, no CUDA headers).
#pragma once
#include "lora_common.cuh"

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {  // dst: a shared-window address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {  // 8 bytes, both 8-byte aligned
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}

// 16 bytes at dst, of which the first src_bytes (0..16) are copied from src and the rest are zeros
// (src_bytes = 0 reads nothing).
__device__ __forceinline__ void cp_async16_zfill(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>  // wait until at most N of this thread's committed groups are still in flight
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Four 8x8 16-bit matrices to shared memory (sm_90): lane l gives the address of row l % 8 of matrix
// l / 8; r[m] is matrix m's row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, as ldmatrix_x4 loads it.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

__device__ __forceinline__ uint4 lds128(u32 addr) {  // addr: a shared-window address
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// 16 bytes to global memory at p (16-byte aligned): one st.global.v4 (a uint4 assigned from
// lds128's outputs goes as four 4-byte stores).
__device__ __forceinline__ void stg128(void* p, uint4 v) {
  asm volatile("{ .reg .u64 t; cvta.to.global.u64 t, %0; st.global.v4.u32 [t], {%1,%2,%3,%4}; }\n" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 16 bytes of a tile from global memory: cp.async where vec (zeros past `valid` elements), else
// element loads and a shared store (visible after the barrier that precedes their use).
__device__ __forceinline__ void tile_piece(u16* dst, const u16* src, const u16* any_valid, bool vec, int valid) {
  if (vec)
    cp_async16_zfill(smem_addr(dst), valid > 0 ? src : any_valid, max(0, valid) * 2);
  else
    *(uint4*)dst = load8(src, false, valid);
}
