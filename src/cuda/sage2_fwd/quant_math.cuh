// Element arithmetic shared by the quantization kernels and the attention kernel's
// in-kernel Q quantization (docs/sage2-kernel-arithmetic.md, steps 1-4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace qattn::sage2 {

inline constexpr float kInt8Max = 127.f;
inline constexpr uint32_t kNaNBits = 0x7fffffff;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return __half2float(x);
}

// Both elements of a packed 16-bit pair as floats.
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) {
  return __bfloat1622float2(x);
}
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }

// NaN-propagating max of |x|: a NaN input must make its group's scale NaN.
__device__ __forceinline__ float amax_nan(float a, float x) {
  const float ax = fabsf(x);
  return (ax != ax || a != a) ? __uint_as_float(kNaNBits) : fmaxf(a, ax);
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

}  // namespace qattn::sage2
