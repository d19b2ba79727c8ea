// wgmma (sm_90a warpgroup MMA) wrappers: one instruction each.
//
// Operand layouts used by qattn (PTX ISA, "Asynchronous Warpgroup Level Matrix"):
// - Accumulator of m64nN: warp w of the warpgroup, lane l (g = l/4, t = l%4) holds,
//   for every 8-column chunk j, d[4j+0..1] = (row 16w+g, cols 8j+2t, 8j+2t+1) and
//   d[4j+2..3] = (row 16w+g+8, same cols).
// - 8-bit A from registers (k32): a[0] = row g, k 4t..4t+3; a[1] = row g+8, same k;
//   a[2] = row g, k 16+4t..16+4t+3; a[3] = row g+8, same k (byte 0 = lowest k).
// - 8-bit operands in shared memory must be K-major (no transpose for 8-bit types).
#pragma once

#include <cstdint>

#include "cuda/hopper/swizzle.h"

namespace qattn::hopper {

// Shared-memory matrix descriptor for a K-major tile written by TMA with the given
// swizzle: rows of `row_bytes` (= swizzle span), 8-row atoms `8 * row_bytes` apart.
template <Swizzle S>
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem_tile) {
  constexpr uint64_t row_bytes = swizzle_bytes(S);
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_tile));
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);       // start address
  desc |= static_cast<uint64_t>(1) << 16;                     // LBO: unused (K-major, swizzled)
  desc |= static_cast<uint64_t>((8 * row_bytes) >> 4) << 32;  // SBO: 8-row atom stride
  desc |= static_cast<uint64_t>(S) << 62;                     // swizzle mode
  return desc;
}

// Advancing K by `bytes` inside a swizzled row moves only the start address; the
// hardware applies the swizzle to the final address (tile bases are 1024-aligned).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Descriptor for an MN-major 16-bit tile written by TMA with the 128-byte swizzle (a
// B operand whose N index is contiguous: V as stored, [tokens][channels], read as the
// B of P·V). Each 128-byte row holds 64 N-elements of one K index; 8 rows (K) form a
// 1024-byte atom, the next 8 K indices follow at SBO = 1024; the next 64 N-elements
// (a second TMA box) start `n_group_bytes` further (LBO). 16-bit types only: 8-bit
// wgmma operands cannot be MN-major.
__device__ __forceinline__ uint64_t make_smem_desc_mn128(const void* smem_tile,
                                                         uint32_t n_group_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_tile));
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);                 // start address
  desc |= static_cast<uint64_t>((n_group_bytes & 0x3FFFF) >> 4) << 16;  // LBO: next 64 N
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;                       // SBO: next 8 K
  desc |= static_cast<uint64_t>(Swizzle::k128B) << 62;
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an async MMA.
template <typename T, int N>
__device__ __forceinline__ void fence_operands(T (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(*reinterpret_cast<uint32_t*>(&r[i]))::"memory");
}
// The same for FP32 registers without a move to integer registers (which the compiler
// may hoist above the wait, where ptxas then serializes every wgmma: C7514).
template <int N>
__device__ __forceinline__ void fence_operands_f32(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The accumulator operands of one wgmma: d[0..n) with constraint C ("+r"/"+f" to
// accumulate, "=r"/"=f" for the first k-step, which overwrites D so the compiler does
// not keep the previous accumulator alive), and the matching register list.
#define QATTN_WGMMA_D8(C, d, b)                                                         \
  C(d[b]), C(d[b + 1]), C(d[b + 2]), C(d[b + 3]), C(d[b + 4]), C(d[b + 5]), C(d[b + 6]), \
      C(d[b + 7])
#define QATTN_WGMMA_D32(C, d) \
  QATTN_WGMMA_D8(C, d, 0), QATTN_WGMMA_D8(C, d, 8), QATTN_WGMMA_D8(C, d, 16), \
      QATTN_WGMMA_D8(C, d, 24)
#define QATTN_WGMMA_D64(C, d) \
  QATTN_WGMMA_D32(C, d), QATTN_WGMMA_D8(C, d, 32), QATTN_WGMMA_D8(C, d, 40), \
      QATTN_WGMMA_D8(C, d, 48), QATTN_WGMMA_D8(C, d, 56)
#define QATTN_WGMMA_REGS64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

#define QATTN_WGMMA_D4(C, d, b) C(d[b]), C(d[b + 1]), C(d[b + 2]), C(d[b + 3])
#define QATTN_WGMMA_D36(C, d) QATTN_WGMMA_D32(C, d), QATTN_WGMMA_D4(C, d, 32)
#define QATTN_WGMMA_D68(C, d) QATTN_WGMMA_D64(C, d), QATTN_WGMMA_D4(C, d, 64)
#define QATTN_WGMMA_REGS36 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, " \
  "%33, %34, %35}"
#define QATTN_WGMMA_REGS68 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, " \
  "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
  "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67}"

// D(64x128, s32) (+)= A(64x32, s8, smem) * B(128x32, s8, smem, K-major)
__device__ __forceinline__ void wgmma_m64n128k32_s8_ss(int32_t (&d)[64], uint64_t desc_a,
                                                       uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " QATTN_WGMMA_REGS64
               ", %64, %65, 1;\n"
               : QATTN_WGMMA_D64("+r", d)
               : "l"(desc_a), "l"(desc_b));
}
// The first k-step: D = A * B.
__device__ __forceinline__ void wgmma_m64n128k32_s8_ss_init(int32_t (&d)[64], uint64_t desc_a,
                                                            uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " QATTN_WGMMA_REGS64
               ", %64, %65, 0;\n"
               : QATTN_WGMMA_D64("=r", d)
               : "l"(desc_a), "l"(desc_b));
}

// D(64x136 / 64x72, f32) (+)= A(64x32, e4m3, registers) * B(136x32 / 72x32, e4m3, smem,
// K-major): P·V where B is Vᵀ (128 / 64 channels) and 8 rows of E4M3 ones, whose columns
// of D return P's row sums (no shuffle reduction of the row sums in the softmax).
__device__ __forceinline__ void wgmma_m64n136k32_e4m3_rs(float (&d)[68], const uint32_t (&a)[4],
                                                         uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS68
               ", {%68, %69, %70, %71}, %72, 1, 1, 1;\n"
               : QATTN_WGMMA_D68("+f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
__device__ __forceinline__ void wgmma_m64n136k32_e4m3_rs_init(float (&d)[68],
                                                              const uint32_t (&a)[4],
                                                              uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS68
               ", {%68, %69, %70, %71}, %72, 0, 1, 1;\n"
               : QATTN_WGMMA_D68("=f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// D(64x128, f32) (+)= A(64x32, e4m3, registers) * B(128x32, e4m3, smem, K-major): the
// first 128 channels of the head-dim-256 P·V (cuda/sage2_wide/), whose ones rows follow
// in its second, n136 product.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS64
               ", {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
               : QATTN_WGMMA_D64("+f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
__device__ __forceinline__ void wgmma_m64n72k32_e4m3_rs(float (&d)[36], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS36
               ", {%36, %37, %38, %39}, %40, 1, 1, 1;\n"
               : QATTN_WGMMA_D36("+f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
__device__ __forceinline__ void wgmma_m64n72k32_e4m3_rs_init(float (&d)[36], const uint32_t (&a)[4],
                                                             uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS36
               ", {%36, %37, %38, %39}, %40, 0, 1, 1;\n"
               : QATTN_WGMMA_D36("=f", d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

#define QATTN_WGMMA_D16(C, d) QATTN_WGMMA_D8(C, d, 0), QATTN_WGMMA_D8(C, d, 8)
#define QATTN_WGMMA_REGS16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define QATTN_WGMMA_REGS32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// The SageBwd products (cuda/sagebwd/dkdv_wgmma.cuh). kAcc = false overwrites D (the
// first k-step), true accumulates.
// D(64x64, s32) (+)= A(64x32, s8, smem) * B(64x32, s8, smem, K-major)
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n64k32_s8_ss(int32_t (&d)[32], uint64_t desc_a,
                                                      uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " QATTN_WGMMA_REGS32
                 ", %32, %33, 1;\n"
                 : QATTN_WGMMA_D32("+r", d)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " QATTN_WGMMA_REGS32
                 ", %32, %33, 0;\n"
                 : QATTN_WGMMA_D32("=r", d)
                 : "l"(desc_a), "l"(desc_b));
}
// D(64x32, s32) (+)= A(64x32, s8, smem) * B(32x32, s8, smem, K-major)
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n32k32_s8_ss(int32_t (&d)[16], uint64_t desc_a,
                                                      uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " QATTN_WGMMA_REGS16
                 ", %16, %17, 1;\n"
                 : QATTN_WGMMA_D16("+r", d)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " QATTN_WGMMA_REGS16
                 ", %16, %17, 0;\n"
                 : QATTN_WGMMA_D16("=r", d)
                 : "l"(desc_a), "l"(desc_b));
}
// D(64x64, s32) (+)= A(64x32, s8, registers) * B(64x32, s8, smem, K-major)
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n64k32_s8_rs(int32_t (&d)[32], const uint32_t (&a)[4],
                                                      uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " QATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, 1;\n"
                 : QATTN_WGMMA_D32("+r", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " QATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, 0;\n"
                 : QATTN_WGMMA_D32("=r", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// The E4M3 twins of the three above (the backward's FP8 format): FP32 accumulators,
// the same operand layouts (8-bit elements, K-major), unit scales of A and B.
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_ss(float (&d)[32], uint64_t desc_a,
                                                        uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS32
                 ", %32, %33, 1, 1, 1;\n"
                 : QATTN_WGMMA_D32("+f", d)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS32
                 ", %32, %33, 0, 1, 1;\n"
                 : QATTN_WGMMA_D32("=f", d)
                 : "l"(desc_a), "l"(desc_b));
}
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n32k32_e4m3_ss(float (&d)[16], uint64_t desc_a,
                                                        uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS16
                 ", %16, %17, 1, 1, 1;\n"
                 : QATTN_WGMMA_D16("+f", d)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS16
                 ", %16, %17, 0, 1, 1;\n"
                 : QATTN_WGMMA_D16("=f", d)
                 : "l"(desc_a), "l"(desc_b));
}
template <bool kAcc>
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  if constexpr (kAcc)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : QATTN_WGMMA_D32("+f", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " QATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, 0, 1, 1;\n"
                 : QATTN_WGMMA_D32("=f", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// D(64x64, f32) (+)= A(64x16, bf16 or f16, smem) * B(64x16, same, smem, K-major)
template <bool kBf16, bool kAcc>
__device__ __forceinline__ void wgmma_m64n64k16_f32_ss(float (&d)[32], uint64_t desc_a,
                                                       uint64_t desc_b) {
#define QATTN_WGMMA_16BIT(TY, SC, C)                                                         \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " QATTN_WGMMA_REGS32 \
               ", %32, %33, " SC ", 1, 1, 0, 0;\n"                                          \
               : QATTN_WGMMA_D32(C, d)                                                      \
               : "l"(desc_a), "l"(desc_b))
  if constexpr (kBf16 && kAcc)
    QATTN_WGMMA_16BIT("bf16", "1", "+f");
  else if constexpr (kBf16)
    QATTN_WGMMA_16BIT("bf16", "0", "=f");
  else if constexpr (kAcc)
    QATTN_WGMMA_16BIT("f16", "1", "+f");
  else
    QATTN_WGMMA_16BIT("f16", "0", "=f");
#undef QATTN_WGMMA_16BIT
}

// The 16-bit forward (cuda/precise_fwd): S = Q·Kᵀ with both operands K-major in shared
// memory, and O += P·V with P from registers and V MN-major (trans-b).
// D(64x128, f32) (+)= A(64x16, bf16 or f16, smem) * B(128x16, same, smem, K-major)
template <bool kBf16, bool kAcc>
__device__ __forceinline__ void wgmma_m64n128k16_f32_ss(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b) {
#define QATTN_WGMMA_16BIT(TY, SC, C)                                                          \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " QATTN_WGMMA_REGS64 \
               ", %64, %65, " SC ", 1, 1, 0, 0;\n"                                           \
               : QATTN_WGMMA_D64(C, d)                                                       \
               : "l"(desc_a), "l"(desc_b))
  if constexpr (kBf16 && kAcc)
    QATTN_WGMMA_16BIT("bf16", "1", "+f");
  else if constexpr (kBf16)
    QATTN_WGMMA_16BIT("bf16", "0", "=f");
  else if constexpr (kAcc)
    QATTN_WGMMA_16BIT("f16", "1", "+f");
  else
    QATTN_WGMMA_16BIT("f16", "0", "=f");
#undef QATTN_WGMMA_16BIT
}
// D(64x128, f32) += A(64x16, registers) * B(128x16, smem, MN-major: trans-b)
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n128k16_f32_rs_tb(float (&d)[64], const uint32_t (&a)[4],
                                                           uint64_t desc_b) {
#define QATTN_WGMMA_16BIT(TY)                                                                 \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " QATTN_WGMMA_REGS64 \
               ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"                                  \
               : QATTN_WGMMA_D64("+f", d)                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
  if constexpr (kBf16)
    QATTN_WGMMA_16BIT("bf16");
  else
    QATTN_WGMMA_16BIT("f16");
#undef QATTN_WGMMA_16BIT
}
// D(64x64, f32) += A(64x16, registers) * B(64x16, smem, MN-major: trans-b)
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_f32_rs_tb(float (&d)[32], const uint32_t (&a)[4],
                                                          uint64_t desc_b) {
#define QATTN_WGMMA_16BIT(TY)                                                                \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " QATTN_WGMMA_REGS32 \
               ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"                                 \
               : QATTN_WGMMA_D32("+f", d)                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
  if constexpr (kBf16)
    QATTN_WGMMA_16BIT("bf16");
  else
    QATTN_WGMMA_16BIT("f16");
#undef QATTN_WGMMA_16BIT
}

#undef QATTN_WGMMA_D16
#undef QATTN_WGMMA_REGS16
#undef QATTN_WGMMA_REGS32
#undef QATTN_WGMMA_D8
#undef QATTN_WGMMA_D32
#undef QATTN_WGMMA_D64
#undef QATTN_WGMMA_REGS64
#undef QATTN_WGMMA_D4
#undef QATTN_WGMMA_D36
#undef QATTN_WGMMA_D68
#undef QATTN_WGMMA_REGS36
#undef QATTN_WGMMA_REGS68

}  // namespace qattn::hopper
