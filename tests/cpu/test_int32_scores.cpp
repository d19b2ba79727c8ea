// The properties the SA2 kernel's softmax relies on for its raw INT32 scores and for
// its exps on the FMA pipe (numerics/exp2_poly.h), and the ones below
// (numerics/int32_scores.h): the magic-number conversion is exact over every product
// two INT8 rows can give, a masked score converts to -inf and loses every integer max,
// and the last visible key per row gives exactly the causal / key-tail mask. Random
// shapes on fixed seeds and on a fresh seed (printed on failure).
#include <gtest/gtest.h>

#include "test_seed.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "numerics/exp2_poly.h"
#include "numerics/formats.h"
#include "numerics/int32_scores.h"

namespace sc = qattn::scores;

namespace {

TEST(Int32Scores, ConversionIsExactForEveryProduct) {
  for (int32_t s = -sc::kMaxAbsScore; s <= sc::kMaxAbsScore; ++s)
    ASSERT_EQ(sc::score_to_float(s), static_cast<float>(s)) << "s = " << s;
}

TEST(Int32Scores, MaskedScoreIsMinusInfinityAndBelowEveryProduct) {
  EXPECT_EQ(sc::score_to_float(sc::kMaskedScore), -std::numeric_limits<float>::infinity());
  EXPECT_LT(sc::kMaskedScore, -sc::kMaxAbsScore);
  // The kernel's row max is an integer max over masked and real scores.
  for (int32_t s : {-sc::kMaxAbsScore, -1, 0, 1, sc::kMaxAbsScore})
    EXPECT_EQ(std::max(sc::kMaskedScore, s), s);
}

// Query row i sees key j iff j < Nkv and (not causal or j <= i + Nkv - Nq): the rule of
// the API (bottom-right aligned causal mask).
bool visible(int nq, int nkv, bool causal, int row, int key) {
  return key < nkv && (!causal || key <= row + (nkv - nq));
}

TEST(Int32Scores, LastVisibleKeyIsTheMaskOfEveryRow) {
  const unsigned seeds[] = {1u, 20261129u, qattn::test::fresh_seed32()};
  for (unsigned seed : seeds) {
    SCOPED_TRACE(qattn::test::seed_trace(seed));
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> len(1, 700);
    for (int c = 0; c < 200; ++c) {
      const int nq = len(rng), nkv = len(rng);
      const bool causal = c % 2 == 1;
      for (int row = 0; row < nq; row += 1 + row / 16) {
        const int last = sc::last_visible_key(nq, nkv, causal, row);
        for (int key = 0; key < nkv + 130; ++key)
          ASSERT_EQ(key <= last, visible(nq, nkv, causal, row, key))
              << "Nq " << nq << " Nkv " << nkv << " causal " << causal << " row " << row << " key "
              << key;
      }
    }
  }
}

// exp2_poly: relative error under 7.6e-5 over the exponents the softmax produces (its
// P is 448·2^(x - max), so x <= log2(448)); below -100 and at -inf it gives 2^-100, which
// casts to E4M3 zero like the true value; and the E4M3 code of 448·P (what the P·V MMA
// reads) is the one of the exact value except within 1e-4 of a rounding boundary.
TEST(Exp2Poly, AccurateToE4m3AndZeroForMaskedScores) {
  using qattn::numerics::exp2_poly;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> xs(-100.f, 9.f);
  int flips = 0;
  constexpr int kSamples = 200000;
  for (int i = 0; i < kSamples; ++i) {
    const float x = xs(rng);
    const double exact = std::exp2(static_cast<double>(x));
    const float got = exp2_poly(x);
    ASSERT_LT(std::abs(got / exact - 1.0), 7.6e-5) << "x=" << x;
    const float p = exact * 0.5;  // the exact 2^(x - 1): a P below 448 for every x here
    if (qattn::numerics::e4m3_encode(exp2_poly(x - 1.f)) != qattn::numerics::e4m3_encode(p))
      ++flips;
  }
  EXPECT_LT(flips, kSamples / 1000) << "E4M3 codes that differ from the exact value's";
  for (float x : {-100.f, -150.f, -1e30f, -std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(exp2_poly(x), exp2_poly(-100.f)) << x;
    EXPECT_EQ(qattn::numerics::e4m3_encode(448.f * exp2_poly(x)), 0) << x;
  }
  EXPECT_NEAR(exp2_poly(std::log2(448.f)), 448.f, 448.f * 7.6e-5);
}

}  // namespace
