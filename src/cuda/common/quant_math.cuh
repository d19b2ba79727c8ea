// Element arithmetic of 8-bit quantization on the GPU: 16-bit loads widened to float,
// INT8 codes by round-to-nearest-even. Shared by the quantization kernels and the
// attention kernel's in-kernel Q quantization (docs/sage2-kernel-arithmetic.md, steps
// 1-4) and by any later family that quantizes to INT8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "numerics/formats.h"

namespace qattn::common {

inline constexpr float kInt8Max = static_cast<float>(numerics::kInt8Max);

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return __half2float(x);
}

// Both elements of a packed 16-bit pair as floats. bf16 widens by a shift and a mask:
// one instruction per element, where the conversion intrinsic takes two for the high
// half.
template <typename T>
__device__ __forceinline__ float2 widen_pair(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// t rounded to nearest even, in the low byte (two's complement), for |t| < 2^22: the
// FADD of 1.5·2^23 has an ULP of 1. Without F2I, which shares the 16/clk/SM pipe with
// the attention kernel's exp2 and needs a clamp.
__device__ __forceinline__ uint32_t int8_byte_rn(float t) {
  return __float_as_uint(t + 12582912.f);
}

// Four values times inv as INT8 codes, low byte first: quantize_int8x4's codes when
// |x| <= amax and inv = 127 / amax is finite (the product is within one rounding of
// ±127, which rounds back to ±127, so no clamp is needed). __fmul_rn: the product is
// rounded on its own, not contracted with the FADD into one FFMA.
__device__ __forceinline__ uint32_t quantize_int8x4_rn(float x0, float x1, float x2, float x3,
                                                       float inv) {
  const uint32_t lo =
      __byte_perm(int8_byte_rn(__fmul_rn(x0, inv)), int8_byte_rn(__fmul_rn(x1, inv)), 0x0040);
  const uint32_t hi =
      __byte_perm(int8_byte_rn(__fmul_rn(x2, inv)), int8_byte_rn(__fmul_rn(x3, inv)), 0x0040);
  return __byte_perm(lo, hi, 0x5410);
}

// Four values times inv, rounded to nearest even and clamped to ±127, packed low byte
// first; all zero when the group's amax is zero or NaN (`zero`).
__device__ __forceinline__ uint32_t quantize_int8x4(const float* x, float inv, bool zero) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int q = zero ? 0 : max(-127, min(127, __float2int_rn(x[j] * inv)));
    w |= static_cast<uint32_t>(q & 0xFF) << (8 * j);
  }
  return w;
}

}  // namespace qattn::common
