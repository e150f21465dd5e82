// Warpgroup tensor-core products (wgmma.mma_async, sm_90a, inline PTX) for the prefill shrink:
// a warpgroup (4 warps) multiplies a 64 x 16 tile of x by a 16 x N tile of A, both read by the
// tensor cores straight from shared memory through matrix descriptors, into fp32 accumulators in
// the registers, asynchronously (commit / wait groups). What mma.sync needs ldmatrix fragments and
// a warp's issue slots for, this does in one instruction a warpgroup and k16 step.
//
// Operands, both in the 128-byte swizzle (the 16-byte chunk c of a 128-byte row r sits at chunk
// c ^ (r % 8), from a 1024-byte boundary):
// - x (the "A" operand, K-major): dense 128-byte rows of 64 features, as the TMA box lands;
//   8-row groups 1024 bytes apart (SBO); a k16 step is 32 bytes further in the row.
// - A (the "B" operand, N-major: imm-trans-b = 1): for each 64-column half of the rank columns,
//   k-rows of 128 bytes, 8-row groups 1024 bytes apart (SBO), the halves LBO bytes apart; a k16 step
//   is two groups (2048 bytes) further.
// Accumulators: thread t of the warpgroup holds, for each n8 tile j, d[4j .. 4j + 3] = rows
// 16 (t / 32) + (t % 32) / 4 (+ 8 for the second pair), columns 8j + 2 (t % 4) (+ 1): per warp
// the layout of mma.sync m16n8k16's accumulators tile by tile.
#pragma once
#include "lora_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LORA_HAVE_WGMMA 1

// A shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (16-byte units in the descriptor).
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32) |
         (1ull << 62);
}

// Before the tensor cores read operands that this thread wrote into shared memory (stores or
// cp.async, the generic proxy; the barrier after it covers the other threads' writes).
__device__ __forceinline__ void wgmma_operands_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Before the first wgmma of a batch: the accumulators' earlier register writes are ordered before it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // until at most N of this warpgroup's committed batches are in flight
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d[0 .. N/2) += x tile (da) @ A tile (db), m64 nN k16, fp32 accumulate; DT as mma16816.
template <int N, int DT> __device__ __forceinline__ void wgmma_m64k16(float* d, u64 da, u64 db);
// The accumulator operands of an m64 nN product: N / 2 fp32 registers, as the asm's output list
// ("{%0, ...}") and its constraints.
#define LORA_WG_REGS_32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define LORA_WG_REGS_64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define LORA_WG_OPS_32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define LORA_WG_OPS_64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// wgmma_m64k16<N, DT> with R = N / 2 accumulators: the descriptors are operands DA and DB, the
// scale-d predicate's source (1: accumulate into d) operand ONE; A K-major, B N-major (trans-b).
#define LORA_WGMMA_M64K16(N, DT, PTX_T, R, DA, DB, ONE)                                            \
  template <> __device__ __forceinline__ void wgmma_m64k16<N, DT>(float* d, u64 da, u64 db) {     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #ONE ", 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " "              \
                 LORA_WG_REGS_##R ", %" #DA ", %" #DB ", p, 1, 1, 0, 1;\n}\n"                       \
                 : LORA_WG_OPS_##R                                                                \
                 : "l"(da), "l"(db), "r"(1));                                                     \
  }
LORA_WGMMA_M64K16(64, 0, "bf16", 32, 32, 33, 34)
LORA_WGMMA_M64K16(64, 1, "f16", 32, 32, 33, 34)
LORA_WGMMA_M64K16(128, 0, "bf16", 64, 64, 65, 66)
LORA_WGMMA_M64K16(128, 1, "f16", 64, 64, 65, 66)
#else
#define LORA_HAVE_WGMMA 0
// Other targets have the same names, never reached (trapping if they were), so that a caller's
// `if constexpr` on a flag that is false off sm_90a (ShrinkTiles::WG, the expand's WG) discards
// them without an #if around it.
__device__ __forceinline__ u64 wgmma_desc(u32, u32, u32) { return 0; }
__device__ __forceinline__ void wgmma_operands_fence() { asm volatile("trap;"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("trap;"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("trap;"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("trap;"); }
template <int N, int DT>
__device__ __forceinline__ void wgmma_m64k16(float*, u64, u64) { asm volatile("trap;"); }
#endif
