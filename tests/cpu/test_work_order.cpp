// The attention kernel's work order (src/cuda/common/work_order.h): every item of a
// grid is visited exactly once; non-causal keeps a head's blocks together; causal takes
// heads in groups, each group's blocks from longest to shortest, and then every head's
// shortest blocks, longest first; the group size keeps a group's K/V within the L2
// budget, counting a GQA K/V head once; and the tail fills the asked rounds of the grid.
#include <gtest/gtest.h>

#include "test_seed.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cuda/common/work_order.h"

namespace {

using qattn::common::causal_group_heads;
using qattn::common::causal_tail_blocks;
using qattn::common::kCausalTailRounds;
using qattn::common::item_place;
using qattn::common::ItemPlace;
using qattn::common::kCausalGroupL2Bytes;
using qattn::common::kv_tile_span;
using qattn::common::mean_kv_tiles_per_item;

// Causal (bottom-right) or no mask, every key.
qattn::numerics::KeyRule plain_rule(int nq, int nkv, bool causal) {
  return qattn::numerics::make_key_rule(nq, nkv, causal, false, -1, -1, nkv);
}

void check_order(int num_m_blocks, int heads, bool causal, int group, int tail) {
  SCOPED_TRACE("blocks=" + std::to_string(num_m_blocks) + " heads=" + std::to_string(heads) +
               " causal=" + std::to_string(causal) + " group=" + std::to_string(group) +
               " tail=" + std::to_string(tail));
  const int items = num_m_blocks * heads;
  std::vector<int> seen(items, 0);
  ItemPlace prev{};
  for (int item = 0; item < items; ++item) {
    const ItemPlace at = item_place(item, num_m_blocks, heads, causal, group, tail);
    ASSERT_GE(at.m_block, 0);
    ASSERT_LT(at.m_block, num_m_blocks);
    ASSERT_GE(at.head, 0);
    ASSERT_LT(at.head, heads);
    ++seen[at.head * num_m_blocks + at.m_block];
    if (!causal) {
      EXPECT_EQ(at.head, item / num_m_blocks);  // a head's blocks are consecutive
      EXPECT_EQ(at.m_block, item % num_m_blocks);
    } else if (item < heads * (num_m_blocks - tail)) {
      EXPECT_EQ(at.head / group, item / (group * (num_m_blocks - tail))) << "item " << item;
      EXPECT_GE(at.m_block, tail) << "item " << item;  // the shortest blocks come last
      // Within a group the blocks never get longer (block m sees m + 1 key tiles).
      if (item > 0 && at.head / group == prev.head / group)
        EXPECT_LE(at.m_block, prev.m_block) << "item " << item;
    } else {
      // The tail: every head's blocks below `tail`, never getting longer.
      EXPECT_LT(at.m_block, tail) << "item " << item;
      if (item > heads * (num_m_blocks - tail))
        EXPECT_LE(at.m_block, prev.m_block) << "item " << item;
    }
    prev = at;
  }
  for (int i = 0; i < items; ++i)
    ASSERT_EQ(seen[i], 1) << "item of head " << i / num_m_blocks << ", block " << i % num_m_blocks;
}

TEST(WorkOrder, EveryItemOnceInEachOrder) {
  for (bool causal : {false, true})
    for (int blocks : {1, 2, 16, 33})
      for (int heads : {1, 7, 128})
        for (int group : {1, 3, 48, 128, 500})
          for (int tail : {0, blocks / 4, blocks}) check_order(blocks, heads, causal, group, tail);
}

TEST(WorkOrder, EveryItemOnceOnRandomGrids) {
  const unsigned seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> blocks(1, 64), heads(1, 200), group(1, 220), grid(1, 200);
  for (int i = 0; i < 50; ++i) {
    const int b = blocks(rng), h = heads(rng);
    check_order(b, h, true, group(rng), causal_tail_blocks(b, h, grid(rng)));
  }
}

TEST(WorkOrder, CausalTailFillsTheAskedRounds) {
  // B = 4, H = 32 on 132 SMs: 2K (16 blocks per head) ends on its 4 shortest blocks of
  // every head, 512 items = 3.9 rounds; 8K (64 blocks) on 4 blocks as well.
  EXPECT_EQ(causal_tail_blocks(16, 128, 132), 4);
  EXPECT_EQ(causal_tail_blocks(64, 128, 132), 4);
  // B = 1, H = 32, 8K: 13 blocks per head (416 items).
  EXPECT_EQ(causal_tail_blocks(64, 32, 132), (kCausalTailRounds * 132 + 31) / 32);
  // Never more than a quarter of a head's blocks; none for one block.
  EXPECT_EQ(causal_tail_blocks(8, 1, 132), 2);
  EXPECT_EQ(causal_tail_blocks(1, 8, 132), 0);
  for (int b = 1; b < 70; b += 3)
    for (int h : {1, 5, 32, 128, 1000}) {
      const int t = causal_tail_blocks(b, h, 132);
      EXPECT_GE(t, 0);
      EXPECT_LE(t, b / 4);
      if (t < b / 4) EXPECT_GE(t * h, kCausalTailRounds * 132);
    }
}

TEST(WorkOrder, CausalGroupsFitTheL2Budget) {
  // d = 128, N = 2K: 512 KB of INT8 K and E4M3 Vᵀ per head: 48 heads in 24 MB.
  EXPECT_EQ(causal_group_heads(2048, 128, 32, 32, 4), 48);
  EXPECT_EQ(causal_group_heads(8192, 128, 32, 32, 4), 12);
  // Larger than the budget alone: one head at a time.
  EXPECT_EQ(causal_group_heads(std::size_t{1} << 20, 128, 32, 32, 4), 1);
  // GQA 32:8 at 8K: 12 K/V heads fit, i.e. 48 query heads, capped at the 32 there are.
  EXPECT_EQ(causal_group_heads(8192, 128, 32, 8, 1), 32);
  // and one K/V head's 4 query heads when a single K/V head exceeds the budget.
  EXPECT_EQ(causal_group_heads(std::size_t{1} << 20, 128, 32, 8, 1), 4);
  for (std::size_t nkv : {128u, 4096u, 17792u, 75648u})
    for (int d : {64, 128}) {
      const int g = causal_group_heads(nkv, d, 24, 24, 1);
      EXPECT_GE(g, 1);
      EXPECT_LE(g, 24);
      if (g > 1) EXPECT_LE(std::size_t(g) * 2 * nkv * d, kCausalGroupL2Bytes);
    }
}

// A query block's KV tile count is the number of 128-key tiles holding a key that one of
// its rows sees (counted here pair by pair: causal aligned bottom-right, Nq != Nkv, rows
// that see nothing), and the launch's mean is their average over the grid's blocks.
TEST(WorkOrder, KvTilesPerBlockCountTheVisibleTiles) {
  const unsigned seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> len(1, 700);
  for (int i = 0; i < 60; ++i) {
    const int nq = i < 4 ? 128 * (i + 1) : len(rng), nkv = i < 4 ? 128 * (i + 1) : len(rng);
    for (bool causal : {false, true}) {
      SCOPED_TRACE("Nq=" + std::to_string(nq) + " Nkv=" + std::to_string(nkv) +
                   " causal=" + std::to_string(causal));
      const int blocks = (nq + 127) / 128;
      long long sum = 0;
      for (int m = 0; m < blocks; ++m) {
        int tiles = 0;  // the last tile with a visible key, plus one
        for (int r = m * 128; r < std::min(nq, (m + 1) * 128); ++r)
          for (int k = 0; k < nkv; ++k)
            if (!causal || k <= r + (nkv - nq)) tiles = std::max(tiles, k / 128 + 1);
        ASSERT_EQ(kv_tile_span(plain_rule(nq, nkv, causal), nq, m).count, tiles) << "block " << m;
        sum += tiles;
      }
      EXPECT_DOUBLE_EQ(mean_kv_tiles_per_item(plain_rule(nq, nkv, causal), nq, blocks),
                       static_cast<double>(sum) / blocks);
    }
  }
  // The launch's threshold (16, launch.cu) against the benchmark grid: non-causal 2K and
  // causal 4K reach it, causal 2K (8.5) and 1K do not.
  EXPECT_EQ(mean_kv_tiles_per_item(plain_rule(2048, 2048, false), 2048, 16), 16.0);
  EXPECT_EQ(mean_kv_tiles_per_item(plain_rule(2048, 2048, true), 2048, 16), 8.5);
  EXPECT_EQ(mean_kv_tiles_per_item(plain_rule(4096, 4096, true), 4096, 32), 16.5);
  EXPECT_EQ(mean_kv_tiles_per_item(plain_rule(1024, 1024, false), 1024, 8), 8.0);
}

}  // namespace
