// The precision guard's rule (src/emulate/precision.h derives it), in the form the GPU
// evaluates per head from four maxima its passes gather: over the head's query rows,
// max a_i² and max a_i²·|q̂_i|² (a_i: the row's INT8 step with sm_scale·log2(e) folded
// in, q̂_i its codes), and over its KV head's tokens, max b_j² and max b_j²·|k̂_j|² (b_j:
// the token's INT8 step of the smoothed K, k̂_j its codes). Host and device.
#pragma once

#include <cmath>

#include "numerics/hd.h"

namespace qattn::numerics {

// ε_E4M3 = 2^-4 / √(8 ln 2), emulate::guard_threshold_nats() as a float.
inline constexpr float kGuardThresholdNats = 0.026541306259000596f;

// σ in nats of the head's worst (query, key) pair: √((A·KN + B·QN) / 12)·ln 2 with A =
// max a², QN = max a²|q̂|², B = max b², KN = max b²|k̂|². NaN when a maximum is NaN.
QATTN_HD float guard_sigma_nats(float q_step2, float q_norm2, float k_step2, float k_norm2) {
  return sqrtf((q_step2 * k_norm2 + k_step2 * q_norm2) / 12.f) * 0.6931471805599453f;
}

// Whether the head runs precisely: σ above the threshold, or NaN (a NaN statistic never
// passes as small; the 16-bit path carries the NaN as the fast one would).
QATTN_HD bool guard_flags(float sigma_nats) { return !(sigma_nats <= kGuardThresholdNats); }

}  // namespace qattn::numerics
