// Input generators shared by the reference and emulator tests.
#pragma once

#include <cstdint>
#include <random>

#include "reference/tensor.h"
#include "test_seed.h"

namespace qattn::testutil {

// Gaussian entries; `channel_bias` adds a per-channel offset drawn once (the
// outlier channels of real K that smoothing removes), `scale` multiplies everything.
inline Tensor4 gaussian(int b, int h, int n, int d, std::uint64_t seed, float scale = 1.0f,
                        float channel_bias = 0.0f) {
  Tensor4 t(b, h, n, d);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> bias(d);
  for (float& x : bias) x = channel_bias * nd(rng);
  for (std::size_t i = 0; i < t.size(); ++i) t.data[i] = scale * (nd(rng) + bias[i % d]);
  return t;
}

// Gaussian entries rounded to multiples of 2^-10 so that x +- 2^-8 is exact in float
// (finite differences perturb float inputs).
inline Tensor4 gaussian_grid(int b, int h, int n, int d, std::uint64_t seed, float scale = 1.0f) {
  Tensor4 t = gaussian(b, h, n, d, seed, scale);
  for (float& x : t.data) x = std::round(x * 1024.0f) / 1024.0f;
  return t;
}

// A seed that differs per run (or QATTN_TEST_SEED's), reported by the caller through
// SCOPED_TRACE(test::seed_trace(seed)) so a failure can be replayed.
using test::fresh_seed;

}  // namespace qattn::testutil
