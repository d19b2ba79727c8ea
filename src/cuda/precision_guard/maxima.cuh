// The precision guard's per-head maxima on the GPU: FP32 values >= 0 merged with atomicMax
// on their bit patterns, which order like the values; a NaN is written as the positive
// quiet NaN, whose pattern is above +inf, so a NaN anywhere in a head wins its maximum.
// Shared by the guard's Q pass (guard.cu) and the SA2-8b K quantizer, which gathers the
// K maxima while it writes the codes (sage2_fwd/quantize.cu).
#pragma once

#include <cstdint>

namespace qattn::guard {

inline constexpr uint32_t kQuietNan = 0x7fc00000u;

__device__ __forceinline__ float nan_max(float a, float b) {
  return (a != a || b != b) ? __uint_as_float(kQuietNan) : fmaxf(a, b);
}

__device__ __forceinline__ float warp_nan_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = nan_max(x, __shfl_xor_sync(0xffffffff, x, o));
  return x;
}

// atomicMax of a value >= 0 (or NaN) on its bit pattern.
__device__ __forceinline__ void atomic_max_bits(float* at, float v) {
  const uint32_t bits = v != v ? kQuietNan : __float_as_uint(v);
  atomicMax(reinterpret_cast<unsigned int*>(at), bits);
}

// One KV head's pair {max b², max b²·|k̂|²} from a group of tokens that share the step b
// (= the group's k_scale) and whose largest |k̂|² is norm2_codes.
__device__ __forceinline__ void merge_k_group(float* head_pair, float step, int norm2_codes) {
  const float step2 = step * step;
  atomic_max_bits(head_pair, step2);
  atomic_max_bits(head_pair + 1, step2 * static_cast<float>(norm2_codes));
}

}  // namespace qattn::guard
