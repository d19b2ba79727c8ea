// The token sample of the SageAttention2-8b quantization (docs/sage2-kernel-arithmetic.md
// steps 1 and 4): which rows the K smoothing vector averages and V's amax bound looks at,
// and the bound itself. Shared by the CPU emulator (quantize.cpp) and the statistics
// kernel (src/cuda/sage2_fwd/quantize.cu), so both pick the same rows and the same bound.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "numerics/hd.h"

namespace qattn::numerics {

// Tokens in the sample: every row when there are at most this many, else this many.
inline constexpr int64_t kSmoothSampleTokens = 256;

// V's amax bound is this many times the sample's amax. A power of two (an exact product);
// 4 keeps Gaussian tails from being flagged (2 flagged ~1 channel in 4000 at N = 2K, and
// each costs the fix-up kernel µs); a scale up to 4x the exact one still maps the largest
// |v| to >= 112 of E4M3's 448, a normal number with the full 3-bit mantissa (bench/NOTES.md, v17a).
inline constexpr float kAmaxSampleMargin = 4.0f;

// Row of the i-th sampled token (i < min(rows, kSmoothSampleTokens)): floor(i·rows/256)
// when rows > 256, else i.
QATTN_HD int64_t sampled_row(int64_t i, int64_t rows) {
  return rows <= kSmoothSampleTokens ? i : i * rows / kSmoothSampleTokens;
}

// The amax bound from the sample's amax s: kAmaxSampleMargin · s when the sample is not
// every row, s itself when it is; FLT_MAX where the product overflows a finite s (NaN and
// inf stay as they are).
QATTN_HD float sampled_amax_bound_of(float s, int64_t rows) {
  float b = rows > kSmoothSampleTokens ? s * kAmaxSampleMargin : s;
  if (b == INFINITY && s != INFINITY) b = FLT_MAX;
  return b;
}

}  // namespace qattn::numerics
