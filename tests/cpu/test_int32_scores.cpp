// The properties the SA2 kernel's softmax relies on for its raw INT32 scores
// (numerics/int32_scores.h): the magic-number conversion is exact over every product
// two INT8 rows can give, a masked score converts to -inf and loses every integer max,
// and the last visible key per row gives exactly the causal / key-tail mask. Random
// shapes on fixed seeds and on a fresh seed (printed on failure).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

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
  const unsigned seeds[] = {1u, 20261129u, std::random_device{}()};
  for (unsigned seed : seeds) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> len(1, 700);
    for (int c = 0; c < 200; ++c) {
      const int nq = len(rng), nkv = len(rng);
      const bool causal = c % 2 == 1;
      for (int row = 0; row < nq; row += 1 + row / 16) {
        const int last = sc::last_visible_key(nq, nkv, causal, row);
        for (int key = 0; key < nkv + 130; ++key)
          ASSERT_EQ(key <= last, visible(nq, nkv, causal, row, key))
              << "Nq " << nq << " Nkv " << nkv << " causal " << causal << " row " << row
              << " key " << key;
      }
    }
  }
}

}  // namespace
