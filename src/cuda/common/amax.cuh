// |x| maxima that propagate NaN (a NaN input must make its group's scale NaN), on floats,
// on their bits, and on packed 16-bit pairs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace qattn::common {

inline constexpr uint32_t kNaNBits = 0x7fffffff;

// NaN-propagating max of |x|.
__device__ __forceinline__ float amax_nan(float a, float x) {
  const float ax = fabsf(x);
  return (ax != ax || a != a) ? __uint_as_float(kNaNBits) : fmaxf(a, ax);
}

// |x| as integer bits: compared as unsigned they order like |x|, with NaN above inf, so
// their max is amax_nan's (after nan_canonical) in one integer instruction.
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & kNaNBits; }
// amax_nan returns this NaN whatever the input's payload.
__device__ __forceinline__ float nan_canonical(uint32_t abs) {
  return __uint_as_float(abs > 0x7f800000u ? kNaNBits : abs);
}

// |x| max over 16-byte chunks of packed 16-bit pairs (T2: __half2 or __nv_bfloat162;
// exact: max commutes with the widening): m starts at `absmax_zero`, `absmax_chunk`
// folds one chunk (8 values) into it, `absmax_float` gives the float amax of m.
template <typename T2>
__device__ __forceinline__ T2 absmax_zero() {
  const uint32_t zero = 0u;
  return *reinterpret_cast<const T2*>(&zero);
}
template <typename T2>
__device__ __forceinline__ void absmax_chunk(T2 (&m)[2], const uint4& raw) {
  auto pair = [](uint32_t w) { return *reinterpret_cast<const T2*>(&w); };
  m[0] = __hmax2_nan(m[0], __habs2(pair(raw.x)));
  m[1] = __hmax2_nan(m[1], __habs2(pair(raw.y)));
  m[0] = __hmax2_nan(m[0], __habs2(pair(raw.z)));
  m[1] = __hmax2_nan(m[1], __habs2(pair(raw.w)));
}
template <typename T2>
__device__ __forceinline__ float absmax_float(const T2 (&m)[2]) {
  const T2 mm = __hmax2_nan(m[0], m[1]);
  return amax_nan(amax_nan(0.f, __low2float(mm)), __high2float(mm));
}

}  // namespace qattn::common
