// The attention kernel's work order (src/cuda/sage2_fwd/work_order.h): every item of a
// grid is visited exactly once; non-causal keeps a head's blocks together; causal takes
// heads in groups, each group's blocks from longest to shortest; and the group size
// keeps a group's K/V within the L2 budget, counting a GQA K/V head once.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cuda/sage2_fwd/work_order.h"

namespace {

using qattn::sage2::causal_group_heads;
using qattn::sage2::item_place;
using qattn::sage2::ItemPlace;
using qattn::sage2::kCausalGroupL2Bytes;

void check_order(int num_m_blocks, int heads, bool causal, int group) {
  SCOPED_TRACE("blocks=" + std::to_string(num_m_blocks) + " heads=" + std::to_string(heads) +
               " causal=" + std::to_string(causal) + " group=" + std::to_string(group));
  const int items = num_m_blocks * heads;
  std::vector<int> seen(items, 0);
  ItemPlace prev{};
  for (int item = 0; item < items; ++item) {
    const ItemPlace at = item_place(item, num_m_blocks, heads, causal, group);
    ASSERT_GE(at.m_block, 0);
    ASSERT_LT(at.m_block, num_m_blocks);
    ASSERT_GE(at.head, 0);
    ASSERT_LT(at.head, heads);
    ++seen[at.head * num_m_blocks + at.m_block];
    if (!causal) {
      EXPECT_EQ(at.head, item / num_m_blocks);  // a head's blocks are consecutive
      EXPECT_EQ(at.m_block, item % num_m_blocks);
    } else {
      EXPECT_EQ(at.head / group, item / (group * num_m_blocks)) << "item " << item;
      // Within a group the blocks never get longer (block m sees m + 1 key tiles).
      if (item > 0 && at.head / group == prev.head / group)
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
        for (int group : {1, 3, 48, 128, 500}) check_order(blocks, heads, causal, group);
}

TEST(WorkOrder, EveryItemOnceOnRandomGrids) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> blocks(1, 64), heads(1, 200), group(1, 220);
  for (int i = 0; i < 50; ++i) check_order(blocks(rng), heads(rng), true, group(rng));
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

}  // namespace
