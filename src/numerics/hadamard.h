// The Walsh–Hadamard rotation of Q and K rows before their quantization
// (emulate::QkRotation::Hadamard).
//
// For a row x of D = 2^m values: x ← (x ∘ s)·H·2^-e, H the Sylvester Hadamard matrix of
// order D (entries ±1), s_c = hadamard_sign(c), and e = ⌈m/2⌉ for Q, ⌊m/2⌋ for K, so
// that the two scales multiply to exactly 1/D and, H·Hᵀ = D·I, q·k is unchanged in exact
// arithmetic: (qR)·(kR') = q·diag(s)·H·Hᵀ·diag(s)·k / D = q·k. Both scales are powers
// of two (exact in binary floating point); the one rounding is the butterflies' FP32
// additions, in the order fixed here (stage h = 1, 2, 4, ..., D/2; pairs (j, j + h)),
// so a kernel that follows it computes the same values.
#pragma once

#include <cstdint>

#include "numerics/hd.h"

namespace qattn::numerics {

// s_c: bit c of a fixed 64-bit pattern, flipped for each further 64 channels; -1 where
// set. Any fixed ±1 pattern keeps the rotation orthogonal; random-looking signs keep
// the rotation from lining up with structured inputs (FlashAttention-3's "random
// orthogonal matrix").
QATTN_HD float hadamard_sign(int c) {
  constexpr std::uint64_t kPattern = 0x9E3779B97F4A7C15ull;
  return (((kPattern >> (c & 63)) ^ static_cast<std::uint64_t>(c >> 6)) & 1u) ? -1.0f : 1.0f;
}

QATTN_HD bool is_power_of_two(int d) { return d > 0 && (d & (d - 1)) == 0; }

// In place; d must be a power of two (is_power_of_two). for_q picks the ⌈m/2⌉ exponent.
QATTN_HD void hadamard_rotate(float* x, int d, bool for_q) {
  int m = 0;
  while ((1 << m) < d) ++m;
  for (int c = 0; c < d; ++c) x[c] *= hadamard_sign(c);
  for (int h = 1; h < d; h *= 2)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const int e = for_q ? (m + 1) / 2 : m / 2;
  const float scale = 1.0f / static_cast<float>(1 << e);
  for (int c = 0; c < d; ++c) x[c] *= scale;
}

}  // namespace qattn::numerics
