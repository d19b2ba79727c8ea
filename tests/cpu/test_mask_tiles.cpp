// The attn_mask pass's tile rules (numerics/mask_tiles.h) against their definition on
// every small tile of values drawn from {-inf, saturated, -0, +0, live}: the class of a
// tile, the early proof of a cut from any prefix of its values, which tiles a block's
// list keeps; and, on the emulator's arithmetic, that a saturated tile adds nothing to a
// row with a live key (the exactness the list rule relies on).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "numerics/additive_mask.h"
#include "numerics/mask_tiles.h"

namespace nu = qattn::numerics;

namespace {

enum Kind { kNegInf, kSaturated, kZero, kLive };
const float kValues[] = {-INFINITY, -3.38e38f, 0.0f, -1.5f};

nu::MaskTileClass defined_class(const std::vector<Kind>& t) {
  bool all_hidden = true, all_zero = true, all_hidden_or_saturated = true;
  for (Kind k : t) {
    all_hidden &= k == kNegInf;
    all_zero &= k == kZero;
    all_hidden_or_saturated &= k == kNegInf || k == kSaturated;
  }
  if (all_hidden) return nu::kTileHidden;
  if (all_zero) return nu::kTileUnchanged;
  if (all_hidden_or_saturated) return nu::kTileSaturated;
  return nu::kTileCut;
}

}  // namespace

TEST(MaskTiles, Bf16SaturationTestEqualsTheFloatComparison) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const std::uint32_t w = bits << 16;
    float f;
    std::memcpy(&f, &w, 4);
    const bool want = std::isfinite(f) && f <= nu::kLowestAdditive;
    ASSERT_EQ(nu::bf16_saturated(bits), want) << std::hex << bits;
  }
}

// The pass's per-value flags against the float definitions, on every 16-bit pattern of
// both dtypes: -inf, ±0, and live (neither -inf, saturated in bf16, nor ±0; a NaN is live).
TEST(MaskTiles, ValueFlagsEqualTheDefinitionOnEveryPattern) {
  for (const bool bf16 : {true, false}) {
    const std::uint32_t neg_inf = bf16 ? 0xff80u : 0xfc00u;
    const std::uint32_t dead_lo = nu::dead_lo_bits(bf16, neg_inf);
    for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
      const bool hidden = bits == neg_inf, zero = (bits & 0x7fffu) == 0;
      const bool saturated = bf16 && nu::bf16_saturated(bits);
      std::uint32_t want = (hidden ? 0u : nu::kSeenVisible) | (zero ? nu::kSeenZero : nu::kSeenNonzero);
      if (!hidden && !zero && !saturated) want |= nu::kSeenLiveNonzero;
      ASSERT_EQ(nu::additive_value_flags(bits, neg_inf, dead_lo), want)
          << (bf16 ? "bf16 " : "fp16 ") << std::hex << bits;
    }
  }
}

// The two-value word steps against the per-value flags: every pattern in each half beside
// the patterns at the rules' edges in the other, and random runs of words.
TEST(MaskTiles, WordFactsEqualTheValueFlagsOfBothHalves) {
  for (const bool bf16 : {true, false}) {
    const std::uint32_t neg_inf = bf16 ? 0xff80u : 0xfc00u;
    const std::uint32_t dead_lo = nu::dead_lo_bits(bf16, neg_inf);
    auto flags = [&](std::uint32_t v) { return nu::additive_value_flags(v, neg_inf, dead_lo); };
    std::vector<std::uint32_t> edges = {0x0000u, 0x8000u, 0x0001u, 0x8001u, 0x7fffu, 0xffffu,
                                        neg_inf, neg_inf - 1, neg_inf + 1, dead_lo, dead_lo - 1,
                                        dead_lo + 1, neg_inf & 0x7fffu, dead_lo & 0x7fffu,
                                        0x3c00u, 0xbc00u, 0x3f80u, 0xbf80u, 0x7c00u, 0x7f80u};
    for (std::uint32_t a = 0; a < 0x10000u; ++a)
      for (std::uint32_t b : edges)
        for (const std::uint32_t w : {a | (b << 16), b | (a << 16)}) {
          nu::AdditiveWordFacts f(neg_inf, dead_lo);
          f.see_word(w);
          ASSERT_EQ(f.flags(), flags(w & 0xffffu) | flags(w >> 16))
              << (bf16 ? "bf16 " : "fp16 ") << std::hex << w;
        }
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int run = 0; run < 20000; ++run) {
      nu::AdditiveWordFacts f(neg_inf, dead_lo);
      std::uint32_t want = 0;
      for (int i = 0, n = 1 + run % 6; i < n; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        // Halves drawn mostly from the edges, so runs of hidden, zero and saturated words occur.
        auto half = [&](unsigned r) { return r % 4 ? edges[(r >> 2) % edges.size()] : (r >> 8) & 0xffffu; };
        const std::uint32_t w = half(static_cast<unsigned>(x)) | (half(static_cast<unsigned>(x >> 32)) << 16);
        f.see_word(w);
        want |= flags(w & 0xffffu) | flags(w >> 16);
      }
      ASSERT_EQ(f.flags(), want) << (bf16 ? "bf16 run " : "fp16 run ") << run;
    }
  }
}

TEST(MaskTiles, SaturatedValuesAreTheOnesTheSoftmaxSaturates) {
  EXPECT_LE(kValues[kSaturated], nu::kLowestAdditive);
  EXPECT_EQ(nu::additive_log2(kValues[kSaturated]), nu::additive_log2(nu::kLowestAdditive));
  EXPECT_GT(kValues[kLive], nu::kLowestAdditive);
}

// Every tile of up to 6 values of the four kinds (4^6): the class from the pass's three
// flags, and the cut proof from every prefix never contradicting the class.
TEST(MaskTiles, ClassAndCutProofEqualTheDefinition) {
  for (int n = 1; n <= 6; ++n) {
    int total = 1;
    for (int i = 0; i < n; ++i) total *= 4;
    for (int code = 0; code < total; ++code) {
      std::vector<Kind> t(n);
      for (int i = 0, c = code; i < n; ++i, c /= 4) t[i] = static_cast<Kind>(c % 4);
      bool vis = false, nonzero = false, live = false, zero = false, live_nonzero = false;
      for (int i = 0; i < n; ++i) {
        const Kind k = t[i];
        vis |= k != kNegInf;
        nonzero |= k != kZero;
        live |= k == kZero || k == kLive;
        zero |= k == kZero;
        live_nonzero |= k == kLive;
        if (nu::additive_cut_proven(zero, nonzero, live_nonzero))
          ASSERT_EQ(defined_class(t), nu::kTileCut) << "n " << n << " code " << code << " prefix " << i;
      }
      ASSERT_EQ(nu::additive_tile_class(vis, nonzero, live), defined_class(t)) << "n " << n << " code " << code;
      // The flag-word forms the pass uses, from the ORed per-value flags of bf16 values.
      std::uint32_t seen = 0;
      for (Kind k : t) {
        const std::uint32_t bits = k == kNegInf ? 0xff80u : k == kSaturated ? 0xff7fu : k == kZero ? 0x8000u : 0xbfc0u;
        seen |= nu::additive_value_flags(bits, 0xff80u, nu::dead_lo_bits(true, 0xff80u));
      }
      ASSERT_EQ(nu::additive_tile_class(seen), defined_class(t)) << "n " << n << " code " << code;
      ASSERT_EQ(nu::additive_cut_proven(seen), defined_class(t) == nu::kTileCut) << "n " << n << " code " << code;
      // The full tile: proven cut iff it is cut.
      ASSERT_EQ(nu::additive_cut_proven(zero, nonzero, live_nonzero), defined_class(t) == nu::kTileCut)
          << "n " << n << " code " << code;
    }
  }
}

TEST(MaskTiles, ListsKeepSaturatedTilesOnlyWithoutAnUnchangedTile) {
  for (bool unchanged : {false, true}) {
    EXPECT_FALSE(nu::list_keeps(nu::kTileHidden, unchanged));
    EXPECT_TRUE(nu::list_keeps(nu::kTileUnchanged, unchanged));
    EXPECT_TRUE(nu::list_keeps(nu::kTileCut, unchanged));
    EXPECT_EQ(nu::list_keeps(nu::kTileSaturated, unchanged), !unchanged);
  }
  EXPECT_TRUE(nu::list_reads(nu::kTileCut));
  EXPECT_TRUE(nu::list_reads(nu::kTileSaturated));
  EXPECT_FALSE(nu::list_reads(nu::kTileUnchanged));
}

// The exactness the list rule rests on, in the kernel's and the emulator's FP32 steps:
// x = s·qk + additive_log2(a); a saturated key's x minus a live key's is so negative that
// exp2 gives 0, for any score a 16-bit input can produce, and alpha = exp2(m_sat - m_live)
// is 0 when the saturated tile comes first.
TEST(MaskTiles, SaturatedKeysAddExactlyNothingBesideALiveKey) {
  const float qk = 0.0884f * 1.4427f;  // 1/sqrt(128) · log2 e
  for (float s_sat : {-1e9f, -3e4f, 0.f, 3e4f, 1e9f})
    for (float s_live : {-1e9f, -3e4f, 0.f, 3e4f, 1e9f})
      for (float a_live : {0.f, -1.5f, -1e4f, -65504.f, -2.29e38f}) {
        const float x_sat = s_sat * qk + nu::additive_log2(-3.38e38f);
        const float x_live = s_live * qk + nu::additive_log2(a_live);
        ASSERT_LT(x_sat, x_live) << s_sat << " " << s_live << " " << a_live;
        EXPECT_EQ(std::exp2(x_sat - x_live), 0.0f) << s_sat << " " << s_live << " " << a_live;
      }
}
