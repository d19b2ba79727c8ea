// Block scales of qattn's quantizers, shared by the host quantizers (quantize.h),
// the CPU emulators and the GPU quantization kernels (QATTN_HD), so all of them
// pick the same scale from the same amax. Rules from docs/design.md, Numerics and
// docs/sage2-kernel-arithmetic.md.
//
// NaN policy: an amax of NaN (the block holds a NaN) gives a NaN scale, and every
// dequantized value of the block is NaN. An amax of ±Inf gives an Inf (INT, FP8)
// or NaN (NVFP4, MXFP4) scale; the block's dequantized values are NaN then too.
#pragma once

#include <cstdint>

#include "numerics/formats.h"
#include "numerics/hd.h"

namespace qattn::numerics {

// max(a, |x|) with NaN sticky (a NaN in either argument gives NaN).
QATTN_HD float amax_accumulate(float a, float x) {
  const float ax = x < 0.0f ? -x : x;
  if (detail::is_nan_bits(detail::bits_of(a)) || detail::is_nan_bits(detail::bits_of(x))) {
    return detail::float_of(detail::kF32QuietNaN);
  }
  return ax > a ? ax : a;
}

// ---- scale = amax / qmax, multiplier = qmax / amax (INT8, INT4, E4M3, E5M2) ---------

// amax / qmax; 0 for an all-zero block.
QATTN_HD float linear_scale(float amax, float qmax) { return amax / qmax; }

// qmax / amax, the multiplier applied before rounding; 0 for an all-zero block, so
// its values are 0 with no division by zero.
QATTN_HD float linear_multiplier(float amax, float qmax) {
  return amax == 0.0f ? 0.0f : qmax / amax;
}

// ---- NVFP4: s = E4M3(amax / 6), elements E2M1(x / s) ------------------------------

// The E4M3 code of the NVFP4 block scale; a non-finite amax gives the NaN code.
QATTN_HD uint8_t nvfp4_scale_code(float amax) {
  const uint32_t b = detail::bits_of(amax) & detail::kF32AbsMask;
  if (b >= detail::kF32InfBits) return kE4M3NaN;
  return e4m3_encode(amax / kE2M1Max);
}

// E2M1 code of x in a block of scale s (0 when s is 0; 0 when s is NaN, which the
// dequantized value E2M1 × s turns back into NaN).
QATTN_HD uint8_t fp4_element_code(float x, float s) {
  return s == 0.0f ? uint8_t{0} : e2m1_encode(x / s);
}

// ---- MXFP4: s = 2^(floor(log2 amax) − 2) as E8M0, elements E2M1(x / s) -----------

inline constexpr int kE2M1MaxExponent = 2;  // 6 = 1.5 · 2^2

// The E8M0 code of the MXFP4 block scale (OCP MX v1.0). amax 0 gives code 0
// (2^-127) and all-zero elements; a non-finite amax gives the NaN code 0xFF.
QATTN_HD uint8_t mxfp4_scale_code(float amax) {
  const uint32_t b = detail::bits_of(amax) & detail::kF32AbsMask;
  if (b >= detail::kF32InfBits) return kE8M0NaN;
  if (b == 0) return e8m0_encode_exponent(kE8M0MinExponent);
  return e8m0_encode_exponent(detail::floor_log2_bits(b) - kE2M1MaxExponent);
}

// ---- SageAttention3 two-level P -------------------------------------------------

// P2 = P / s_p1 spans [0, 448·6], the range of an E4M3 scale times an E2M1 value.
inline constexpr float kTwoLevelPRange = kE4M3Max * kE2M1Max;

// s_p1 = rowmax / (448·6) in FP32.
QATTN_HD float two_level_p_scale(float rowmax) { return rowmax / kTwoLevelPRange; }

}  // namespace qattn::numerics
