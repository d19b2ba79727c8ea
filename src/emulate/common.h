// Constants and helpers shared by the CPU emulators.
#pragma once

#include <cmath>
#include <limits>

#include "reference/tensor.h"

namespace qattn::emulate {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
inline constexpr float kLn2 = 0.6931471805599453f;
// log2(e) as the kernels use it: sm_scale·log2(e) is an FP32 product there.
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr double kLog2eDouble = 1.4426950408889634;

// max that keeps a NaN (std::fmax drops it): a NaN score must reach O and the LSE
// (docs/design.md, Numerics) instead of making its row look fully masked.
inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

// The sizes of one (batch, head) slice of an attention call, for the per-head loops.
struct HeadShape {
  int nq, nkv, d;
  float sm_scale;
  Mask mask;
};

}  // namespace qattn::emulate
