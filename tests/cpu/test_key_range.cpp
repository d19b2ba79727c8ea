// The key-visibility rule of the SA2 forward (numerics/key_range.h): the interval it
// gives per row equals the element-wise definition of causal + sliding window + key
// padding, in both alignments; its bounds never decrease from one row to the next (the
// kernel decides whole tiles from a block's first and last rows); and a window side of
// max(Nq, Nkv) or more hides nothing; the tiles a 128-row item visits (work_order.h)
// cover every key its rows see, and start and end in tiles some row sees. Random rules
// on fixed seeds and a fresh seed.
#include <gtest/gtest.h>

#include "test_seed.h"

#include <algorithm>
#include <cstdint>
#include <random>

#include "cuda/common/work_order.h"
#include "numerics/key_range.h"

namespace nu = qattn::numerics;

namespace {

// The definition (qattn.h, qattn_fwd_params), in 64-bit arithmetic.
bool visible(int nq, int nkv, bool causal, bool top_left, int left, int right, int kv_len, int i,
             int j) {
  const int64_t diag = top_left ? i : int64_t{i} + nkv - nq;
  const int64_t len = kv_len < 0 ? 0 : (kv_len > nkv ? nkv : kv_len);
  if (j >= len) return false;
  if (causal && j > diag) return false;
  if (right >= 0 && j > diag + right) return false;
  if (left >= 0 && j < diag - left) return false;
  return true;
}

void check_random_rules(std::uint64_t seed, int rounds) {
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int round = 0; round < rounds; ++round) {
    const int nq = pick(1, 300), nkv = pick(1, 300);
    const bool causal = pick(0, 1) == 1, top_left = pick(0, 1) == 1;
    const int left = pick(0, 2) == 0 ? -1 : pick(0, 400);
    const int right = pick(0, 2) == 0 ? -1 : pick(0, 400);
    const int kv_len = pick(0, 3) == 0 ? nkv : pick(-3, nkv + 3);
    const nu::KeyRule rule = nu::make_key_rule(nq, nkv, causal, top_left, left, right, kv_len);
    SCOPED_TRACE(::testing::Message() << "nq " << nq << " nkv " << nkv << " causal " << causal
                                      << " top_left " << top_left << " left " << left
                                      << " right " << right << " kv_len " << kv_len);
    int prev_first = INT32_MIN, prev_last = INT32_MIN;
    for (int i = 0; i < nq; ++i) {
      const nu::KeyRange r = rule.keys(i);
      for (int j = 0; j < nkv; ++j)
        ASSERT_EQ(rule.visible(i, j), visible(nq, nkv, causal, top_left, left, right, kv_len, i, j))
            << "row " << i << " key " << j;
      // The interval is exactly the visible set: its ends are visible unless empty.
      if (!r.empty()) {
        ASSERT_TRUE(visible(nq, nkv, causal, top_left, left, right, kv_len, i, r.first));
        ASSERT_TRUE(visible(nq, nkv, causal, top_left, left, right, kv_len, i, r.last));
      }
      ASSERT_GE(r.first, prev_first) << "row " << i;
      ASSERT_GE(r.last, prev_last) << "row " << i;
      prev_first = r.first, prev_last = r.last;
    }
  }
}

// The SA2 kernel's item tiles: every visible key of the item's rows lies in its span, and
// the span's first and last tiles each hold a key some row sees (no wasted end tiles);
// an item with no visible key has an empty span.
void check_tile_spans(std::uint64_t seed, int rounds) {
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  constexpr int kRows = qattn::common::kItemRows, kTile = 128;
  for (int round = 0; round < rounds; ++round) {
    const int nq = pick(1, 900), nkv = pick(1, 900);
    const nu::KeyRule rule = nu::make_key_rule(
        nq, nkv, pick(0, 1) == 1, pick(0, 1) == 1, pick(0, 2) == 0 ? -1 : pick(0, 600),
        pick(0, 2) == 0 ? -1 : pick(0, 600), pick(0, 3) == 0 ? nkv : pick(0, nkv));
    for (int m = 0; m * kRows < nq; ++m) {
      const qattn::common::TileSpan span = qattn::common::kv_tile_span(rule, nq, m);
      int lo_tile = INT32_MAX, hi_tile = -1;
      for (int i = m * kRows; i < std::min(nq, (m + 1) * kRows); ++i) {
        const nu::KeyRange r = rule.keys(i);
        if (r.empty()) continue;
        lo_tile = std::min(lo_tile, r.first / kTile);
        hi_tile = std::max(hi_tile, r.last / kTile);
      }
      SCOPED_TRACE(::testing::Message() << "nq " << nq << " nkv " << nkv << " block " << m
                                        << " left " << rule.left << " right " << rule.right
                                        << " kv_len " << rule.kv_len << " offset " << rule.offset);
      if (hi_tile < 0) {
        ASSERT_EQ(span.count, 0);
        continue;
      }
      ASSERT_EQ(span.first, lo_tile);
      ASSERT_EQ(span.first + span.count - 1, hi_tile);
    }
  }
}

TEST(KeyRange, ItemTileSpansAreExact) {
  check_tile_spans(7, 200);
  check_tile_spans(qattn::test::fresh_seed(), 200);
}

TEST(KeyRange, EqualsTheDefinitionOnFixedSeeds) {
  for (std::uint64_t seed : {1u, 2u, 3u}) check_random_rules(seed, 300);
}

TEST(KeyRange, EqualsTheDefinitionOnAFreshSeed) { check_random_rules(qattn::test::fresh_seed(), 300); }

// The plain rules: none, causal (bottom-right and top-left), as the kernel's older
// CausalMask stated them.
TEST(KeyRange, PlainRules) {
  const nu::KeyRule none = nu::make_key_rule(5, 9, false, false, -1, -1, 9);
  EXPECT_EQ(none.keys(0).first, 0);
  EXPECT_EQ(none.keys(4).last, 8);
  EXPECT_FALSE(none.bounded());
  const nu::KeyRule br = nu::make_key_rule(5, 9, true, false, -1, -1, 9);
  EXPECT_EQ(br.keys(0).last, 4);  // i + Nkv - Nq
  EXPECT_EQ(br.keys(4).last, 8);
  const nu::KeyRule tl = nu::make_key_rule(5, 9, true, true, -1, -1, 9);
  EXPECT_EQ(tl.keys(0).last, 0);
  EXPECT_EQ(tl.keys(4).last, 4);
  // Nq > Nkv bottom-right: the first rows see nothing.
  const nu::KeyRule empty_rows = nu::make_key_rule(9, 5, true, false, -1, -1, 5);
  EXPECT_TRUE(empty_rows.keys(3).empty());
  EXPECT_FALSE(empty_rows.keys(4).empty());
}

// Window sides of max(Nq, Nkv) or more become unbounded, so sums stay inside int even at
// the largest lengths (2^30) and the largest window.
TEST(KeyRange, WideWindowsAreUnboundedAndDoNotOverflow) {
  const int n = 1 << 30;
  const nu::KeyRule r = nu::make_key_rule(n, n, false, false, INT32_MAX, INT32_MAX, n);
  EXPECT_EQ(r.left, -1);
  EXPECT_EQ(r.right, -1);
  EXPECT_EQ(r.keys(n - 1).first, 0);
  EXPECT_EQ(r.keys(0).last, n - 1);
  const nu::KeyRule w = nu::make_key_rule(n, n, false, false, n - 1, n - 1, n);
  EXPECT_EQ(w.keys(0).first, 0);
  EXPECT_EQ(w.keys(0).last, n - 1);
  EXPECT_EQ(w.keys(n - 1).first, 0);
  // causal overrides any right side
  EXPECT_EQ(nu::make_key_rule(8, 8, true, false, -1, 5, 8).right, 0);
}

}  // namespace
