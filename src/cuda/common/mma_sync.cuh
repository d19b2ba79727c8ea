// Warp-level tensor-core primitives (sm_80 and later): ldmatrix, mma.sync for INT8 and
// 16-bit operands, and cp.async. Fragment maps, with g = lane / 4 and t = lane % 4:
//   m16n8k32 s8 A (16 × 32, row-major):  a0 (g, 4t..4t+3)  a1 (g+8, 4t..)
//                                        a2 (g, 16+4t..)   a3 (g+8, 16+4t..)
//   m16n8k32 s8 B (32 × 8, stored [n][k]): b0 (k 4t..4t+3, n g)  b1 (k 16+4t.., n g)
//   m16n8k16 f16 A/B: the same bytes (two 16-bit elements where INT8 has four)
//   C (16 × 8, s32 or f32): c0 c1 (g, 2t, 2t+1)  c2 c3 (g+8, 2t, 2t+1)
// So one ldmatrix.x4 of 16 rows × 32 bytes fills an A fragment, and one of 16 [n] rows
// × 32 bytes fills the B fragments of two n-blocks, for either operand width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace qattn::common {

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 × 16-byte matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same, transposed: lane l's row of matrix l / 8 lands as columns (the B fragment
// of a [k][n] row-major tile).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Stores four 8×8 matrices of 16-bit elements, each transposed (sm_90): register j holds
// matrix j's pair of row lane/4, columns 2·(lane%4) and +1; lane l gives the address of
// the 16-byte row l % 8 of matrix l / 8, which receives that matrix's column l % 8.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The shared-memory row address lane `lane` passes to ldmatrix_x4 for an A fragment
// (16 rows × 32 bytes at `base`, rows `stride` bytes apart): matrices (rows 0-7, bytes
// 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31).
__device__ __forceinline__ uint32_t ldsm_a_addr(uint32_t base, int stride, int lane) {
  return base + ((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (lane >> 4) * 16;
}
// ... and for the B fragments of two n-blocks (16 [n] rows × 32 bytes): matrices
// (n 0-7, bytes 0-15) = b0 of the first, (0-7, 16-31) = its b1, then the second's.
__device__ __forceinline__ uint32_t ldsm_b_addr(uint32_t base, int stride, int lane) {
  return base + ((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 16;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The E4M3 twin of mma_s8 (FP32 accumulators; the same fragment layouts).
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The transpose of an 8×8 matrix of 16-bit elements held one pair per thread (row
// lane/4, columns 2·(lane%4) and +1), returned in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// *p += a, *(p + 1) += b as one global reduction (sm_90: red.global.add.v2.f32); p is
// 8-byte aligned.
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// 16 bytes global -> shared, asynchronous (L2 only: every tile is read once per CTA).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// cp.async of `kBytes` (4, 8 or 16) with zero fill: src_bytes = 0 writes zeros and reads
// nothing (src must still be a valid address expression; it is not dereferenced).
template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
                 "n"(kBytes), "r"(src_bytes));
  }
}

// The same copy in cp.async's ignore-src form: where !read it writes zeros and src is
// never used, so the caller needs no valid address and no computed source size (ptxas
// turns the flag straight into the copy's predicate).
template <int kBytes>
__device__ __forceinline__ void cp_async_or_zeros(uint32_t dst, const void* src, bool read) {
  if constexpr (kBytes == 16) {
    asm volatile(
        "{\n .reg .pred z;\n setp.eq.u32 z, %2, 0;\n"
        " cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(dst),
        "l"(src), "r"(static_cast<uint32_t>(read)));
  } else {
    asm volatile(
        "{\n .reg .pred z;\n setp.eq.u32 z, %2, 0;\n"
        " cp.async.ca.shared.global [%0], [%1], %3, z;\n}\n" ::"r"(dst),
        "l"(src), "r"(static_cast<uint32_t>(read)), "n"(kBytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace qattn::common
