// The boolean attn_mask's words as the tile pass forms them (numerics/mask_bits.h): for
// random rows of 128 keys, an OR over the 32 lanes' lane_group_bits gives, for every
// column group t, exactly the definition's word (key 8j + 2t + e of the tile at bit
// 2j + e: the consumers' order, attn_mask.cuh); visible_bytes tests every byte value.
// Rows of fixed seeds, a fresh seed, and the all-hidden and all-visible rows.
#include <gtest/gtest.h>

#include "test_seed.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <random>

#include "numerics/mask_bits.h"

namespace nu = qattn::numerics;

namespace {

using Row = std::array<std::uint8_t, 128>;

// The definition: a byte not 0 is a visible key.
unsigned defined_word(const Row& row, int t) {
  unsigned w = 0;
  for (int j = 0; j < 16; ++j)
    for (int e = 0; e < 2; ++e)
      if (row[8 * j + 2 * t + e] != 0) w |= 1u << (2 * j + e);
  return w;
}

// What the pass computes: lane l loads bytes 4l .. 4l + 3 as one little-endian word.
unsigned pass_word(const Row& row, int t) {
  unsigned w = 0;
  for (int lane = 0; lane < 32; ++lane) {
    unsigned x;
    std::memcpy(&x, row.data() + 4 * lane, 4);
    w |= nu::lane_group_bits(nu::visible_bytes(x), lane, t);
  }
  return w;
}

void check_rows(std::uint64_t seed, int rows) {
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  for (int r = 0; r < rows; ++r) {
    Row row;
    // Dense, sparse and arbitrary byte values (a bool tensor holds 0/1; the pass takes
    // any non-zero byte as visible).
    const int density = static_cast<int>(rng() % 3);
    for (auto& b : row) {
      const auto v = static_cast<std::uint8_t>(rng());
      b = density == 0 ? (v % 2) : density == 1 ? (v % 7 == 0 ? 1 : 0) : v;
    }
    for (int t = 0; t < 4; ++t) ASSERT_EQ(pass_word(row, t), defined_word(row, t)) << "t " << t;
  }
}

}  // namespace

TEST(MaskBits, VisibleBytesIsTheByteTest) {
  for (unsigned v = 0; v < 256; ++v)
    for (int b = 0; b < 4; ++b) {
      // Byte b holds v; another byte holds a visible value that must not leak into b.
      const unsigned x = (v << (8 * b)) | (0x5au << (8 * ((b + 1) % 4)));
      const unsigned nz = nu::visible_bytes(x);
      ASSERT_EQ((nz >> (8 * b)) & 0xffu, v != 0 ? 1u : 0u) << "value " << v << " in byte " << b;
    }
  EXPECT_EQ(nu::visible_bytes(0u), 0u);
  EXPECT_EQ(nu::visible_bytes(0xffffffffu), 0x01010101u);
  EXPECT_EQ(nu::visible_bytes(0x80000100u), 0x01000100u);
}

TEST(MaskBits, WordsEqualTheDefinitionOnFixedSeeds) {
  for (std::uint64_t seed : {1u, 2u, 3u}) check_rows(seed, 2000);
}

TEST(MaskBits, WordsEqualTheDefinitionOnAFreshSeed) { check_rows(qattn::test::fresh_seed(), 2000); }

TEST(MaskBits, AllHiddenAndAllVisibleRows) {
  Row hidden{}, visible;
  visible.fill(1);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(pass_word(hidden, t), 0u);
    EXPECT_EQ(pass_word(visible, t), 0xffffffffu);
  }
}
