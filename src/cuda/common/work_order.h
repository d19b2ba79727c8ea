// The work items of a persistent attention grid: (128-row query block, query head)
// pairs, the order in which the CTAs take them (item_place), the size of the causal
// head groups, and how many KV tiles each item visits (a launch may choose its kernel
// shape by their mean). Plain C++ usable on both sides, so the CPU tests can check that
// the order visits every item exactly once, and the tile counts.
#pragma once

#include <algorithm>
#include <cstddef>

#include "numerics/hd.h"
#include "numerics/int32_scores.h"
#include "numerics/key_range.h"
#include "numerics/mma_groups.h"

namespace qattn::common {

// Query rows of one work item (a CTA's query block); the workspace pads Nq to it.
inline constexpr int kItemRows = 128;

// Where item number `item` is: its 128-row query block and its query head, numbered
// b · Hq + hq over all `heads` = B · Hq.
struct ItemPlace {
  int m_block, head;
};

// Non-causal: the query blocks of one head are consecutive items, so the items in
// flight share that head's K/V in L2 (with query blocks slowest, a causal grid thrashed
// L2 and ran 6% slower at N = 8K). Causal: the heads go in groups of `causal_group`
// whose K/V fit in L2 together, and within a group every head's longest block (the last
// one) comes first, then every head's next longest (kernel-only causal 2K +9% over
// longest-first within each head). The `tail_blocks` shortest blocks of every head are
// left out of the groups and come last, all heads together, longest first: the grid
// ends on several rounds of short items however few heads the last group has (they read
// only the first K/V tiles of each head). Measured: bench/NOTES.md.
QATTN_HD ItemPlace item_place(int item, int num_m_blocks, int heads, bool causal, int causal_group,
                              int tail_blocks) {
  if (!causal) {
    const int r = item / num_m_blocks, m = item % num_m_blocks;
    return {m, r};
  }
  const int group_blocks = num_m_blocks - tail_blocks;  // per head, in the groups
  const int grouped = heads * group_blocks;
  if (item >= grouped) {
    const int i = item - grouped;
    return {tail_blocks - 1 - i / heads, i % heads};
  }
  const int per_group = causal_group * group_blocks;
  const int g = item / per_group, i = item % per_group;
  const int in_group = std::min(causal_group, heads - g * causal_group);
  const int r = g * causal_group + i % in_group;
  return {num_m_blocks - 1 - i / in_group, r};
}

// Rounds of the grid that the causal order's tail of short blocks should fill: the SA2
// forward's Q loader claims up to two items ahead of the one running
// (sage2_fwd/scheduler.cuh), so the last claims must be short for the CTAs to end
// together.
inline constexpr int kCausalTailRounds = 3;

// The number of shortest blocks per head in the causal order's tail: enough for
// kCausalTailRounds items per CTA, at most a quarter of a head's blocks.
inline int causal_tail_blocks(int num_m_blocks, int heads, int grid) {
  if (heads <= 0) return 0;
  const int want = (kCausalTailRounds * grid + heads - 1) / heads;
  return std::min(want, num_m_blocks / 4);
}

// The KV tiles a query block visits: from the tile of the first key its first row sees
// to the tile of the last key its last row sees (numerics/key_range.h: both ends never
// decrease from row to row); none when no row of the block sees a key (then the last
// row's last key is below the first row's first key).
struct TileSpan {
  int first, count;
};
QATTN_HD TileSpan kv_tile_span(const numerics::KeyRule& rule, int seqlen_q, int m_block) {
  const int first_row = m_block * kItemRows;
  const int last_row = std::min((m_block + 1) * kItemRows, seqlen_q) - 1;
  const int first_key = rule.first_key(first_row), last_key = rule.last_key(last_row);
  if (last_key < first_key) return {0, 0};
  const int first = first_key / groups::kKvTile;
  return {first, last_key / groups::kKvTile - first + 1};
}

// The mean tile count over a grid's query blocks under `rule` (key padding aside: the
// lengths are on the device): the SA2 launch chooses the attention kernel's register
// split by it (sage2_fwd/launch.cu).
inline double mean_kv_tiles_per_item(const numerics::KeyRule& rule, int seqlen_q,
                                     int num_m_blocks) {
  if (num_m_blocks <= 0) return 0.0;
  // Without a bound every block sees every key: no loop on the call's host path.
  if (!rule.bounded()) return kv_tile_span(rule, seqlen_q, 0).count;
  long long tiles = 0;
  for (int m = 0; m < num_m_blocks; ++m) tiles += kv_tile_span(rule, seqlen_q, m).count;
  return static_cast<double>(tiles) / num_m_blocks;
}

// L2 that a causal group's K/V may take (the H200 has 50 MB; the rest holds Q and O).
// 12 and 48 MB were slower at some N, and all heads in one group thrashed L2 from
// N = 4K (measured: bench/NOTES.md).
inline constexpr std::size_t kCausalGroupL2Bytes = std::size_t{24} << 20;

// Query heads per causal group: as many as read INT8 K and E4M3 Vᵀ (nkv_pad · D bytes
// each) within kCausalGroupL2Bytes; with GQA the Hq / Hkv query heads that share a K/V
// head count once. At least one K/V head's worth, at most all heads.
inline int causal_group_heads(std::size_t nkv_pad, int head_dim_padded, int heads_q, int heads_kv,
                              int batch) {
  const std::size_t kv_bytes = 2 * nkv_pad * static_cast<std::size_t>(head_dim_padded);
  const std::size_t kv_heads = std::max<std::size_t>(1, kCausalGroupL2Bytes / kv_bytes);
  return static_cast<int>(std::min(kv_heads * static_cast<std::size_t>(heads_q / heads_kv),
                                   static_cast<std::size_t>(heads_q) * batch));
}

}  // namespace qattn::common
