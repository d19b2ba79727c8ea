// The 8-bit format of the SageBwd backward's four quantized products (qattn_bwd_format):
//   INT8 (SageBwd): scale amax/127, codes in [-127, 127], products summed in INT32;
//   E4M3 (the paper's FP8 comparison, §5.4): scale amax/448, E4M3 codes, FP32 sums.
// The emulator's Bwd8Format (src/emulate/sagebwd.h). Everything else is shared: the data
// flow, the workspace layouts and the register fragments (s8 and e4m3 operands of wgmma
// and mma.sync have the same layouts), so the kernels take a Format8 as a template
// argument and differ only in what it supplies: codes, accumulators and instructions.
#pragma once

#include <cstdint>

#include "cuda/common/e4m3.cuh"
#include "cuda/common/mma_sync.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/hopper/wgmma.cuh"

namespace qattn::sagebwd {

// E4M3MergeFree: the E4M3 codes with the merge-free scales (qattn_bwd_scales; the
// emulator's Bwd8Scales::MergeFree): fixed before the kernel, so every product adds into
// its accumulator in place.
enum class Code8 { Int8, E4M3, E4M3MergeFree };

// An INT32 accumulator as float, exactly, for |i| < 2^22 (an IADD and an FADD on the full-
// rate pipes instead of I2F at a quarter rate). Every accumulator here is a sum of at
// most 128 products of two codes in [-127, 127]: |i| <= 128·127² < 2^21.
__device__ __forceinline__ float i2f_exact(int i) {
  return __int_as_float(i + 0x4B400000) - 12582912.0f;
}

// qmax / amax, or 0 when amax is 0 or so small (below 2^-100) that qmax / amax could
// overflow: such a tile's P or dS adds nothing an FP32 sum could hold, and a zero
// multiplier keeps its codes 0 instead of NaN.
__device__ __forceinline__ float code_multiplier(float amax, float qmax) {
  return amax < 7.9e-31f ? 0.0f : qmax / amax;
}

template <Code8 F>
struct Format8;

template <>
struct Format8<Code8::Int8> {
  using Acc = int32_t;
  static constexpr float kMax = common::kInt8Max;
  static constexpr bool kIntegerSums = true;
  static constexpr bool kMergeFree = false;
  static __device__ __forceinline__ float to_float(int32_t i) { return i2f_exact(i); }
  // Four values times inv as codes, low byte first: the emulator's clamp_rne codes,
  // since |x| <= amax makes |x·inv| round to at most 127 (common::quantize_int8x4_rn).
  static __device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d, float inv) {
    return common::quantize_int8x4_rn(a, b, c, d, inv);
  }
  static __device__ __forceinline__ void mma(int32_t (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    common::mma_s8(c, a, b0, b1);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n64_ss(int32_t (&d)[32], uint64_t da, uint64_t db) {
    hopper::wgmma_m64n64k32_s8_ss<kAcc>(d, da, db);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n32_ss(int32_t (&d)[16], uint64_t da, uint64_t db) {
    hopper::wgmma_m64n32k32_s8_ss<kAcc>(d, da, db);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n64_rs(int32_t (&d)[32], const uint32_t (&a)[4],
                                                      uint64_t db) {
    hopper::wgmma_m64n64k32_s8_rs<kAcc>(d, a, db);
  }
};

template <>
struct Format8<Code8::E4M3> {
  using Acc = float;
  static constexpr float kMax = common::kE4M3Max;
  static constexpr bool kIntegerSums = false;
  static constexpr bool kMergeFree = false;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  // Four values times inv as E4M3 codes (round to nearest even, saturating), low byte
  // first: numerics::e4m3_encode(x·inv), the product rounded on its own as there.
  static __device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d, float inv) {
    const uint32_t lo = common::pack_e4m3x2(__fmul_rn(a, inv), __fmul_rn(b, inv));
    const uint32_t hi = common::pack_e4m3x2(__fmul_rn(c, inv), __fmul_rn(d, inv));
    return lo | (hi << 16);
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    common::mma_e4m3(c, a, b0, b1);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n64_ss(float (&d)[32], uint64_t da, uint64_t db) {
    hopper::wgmma_m64n64k32_e4m3_ss<kAcc>(d, da, db);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n32_ss(float (&d)[16], uint64_t da, uint64_t db) {
    hopper::wgmma_m64n32k32_e4m3_ss<kAcc>(d, da, db);
  }
  template <bool kAcc>
  static __device__ __forceinline__ void wgmma_n64_rs(float (&d)[32], const uint32_t (&a)[4],
                                                      uint64_t db) {
    hopper::wgmma_m64n64k32_e4m3_rs<kAcc>(d, a, db);
  }
};

template <>
struct Format8<Code8::E4M3MergeFree> : Format8<Code8::E4M3> {
  static constexpr bool kMergeFree = true;
};

}  // namespace qattn::sagebwd
