// Quantization groups that follow the Hopper wgmma fragment layout.
//
// SageAttention2 §3.2 ("per-thread" quantization): choose the groups of Q rows and
// K tokens so that every thread of the Q·Kᵀ MMA multiplies its accumulator
// elements by exactly one Q scale and one K scale. The groups below are defined by
// the sm_90a wgmma m64nNk32 accumulator layout, which the qattn Hopper kernel uses:
//
//   A warpgroup owns 64 query rows; warp w (0..3) owns rows 16w..16w+15; lane l has
//   g = l / 4 and t = l % 4 and holds rows 16w + g and 16w + g + 8, and, in every
//   8-column chunk j of the tile, columns 8j + 2t and 8j + 2t + 1.
//
// Hence:
//   Q per-thread group of row r  = (r / 64, (r % 64) / 16, r % 8): 32 groups of two
//                                  rows in every 64-row block.
//   K per-thread group of token c = (c / kKvTile, (c % 8) / 2): 4 groups of kKvTile/4
//                                  tokens in every KV tile.
// Per-warp groups are 16 query rows; per-block groups are one Q block (kQBlock rows)
// or one KV tile (kKvTile tokens).
#pragma once

#include <cstdint>

#include "numerics/hd.h"

namespace qattn::groups {

inline constexpr int kQBlock = 64;     // query rows per wgmma warpgroup tile
inline constexpr int kQWarpRows = 16;  // query rows per warp
inline constexpr int kKvTile = 128;    // tokens per KV tile (the kernel's kBlockN)

inline constexpr int kQThreadGroupsPerBlock = 32;  // 4 warps x 8 lane groups
inline constexpr int kKThreadGroupsPerTile = 4;    // t = lane % 4

// Index of the per-thread Q group of row r inside its 64-row block (0..31).
QATTN_HD int q_thread_group_in_block(int r) { return ((r % kQBlock) / kQWarpRows) * 8 + (r % 8); }
// Global per-thread Q group index of row r.
QATTN_HD int q_thread_group(int r) {
  return (r / kQBlock) * kQThreadGroupsPerBlock + q_thread_group_in_block(r);
}
// Index of the per-thread K group of token c inside its KV tile (0..3).
QATTN_HD int k_thread_group_in_tile(int c) { return (c % 8) / 2; }
// Global per-thread K group index of token c.
QATTN_HD int k_thread_group(int c) {
  return (c / kKvTile) * kKThreadGroupsPerTile + k_thread_group_in_tile(c);
}

// The FP8 P·V wgmma takes P straight from the Q·Kᵀ accumulator registers. A thread
// holds score columns {2t, 2t+1, 8+2t, 9+2t} of each 16-token group, but the 8-bit A
// fragment reads k = 4t..4t+3. Storing Vᵀ with each group of 16 tokens in this order
// makes the two agree; k is summed over, so the permutation is exact.
// kVPermute16[k] = the token (within its group of 16) stored at position k.
inline constexpr int kVPermute16[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

QATTN_HD int v_token_at_position(int k) {
  constexpr int p[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
  return (k & ~15) | p[k & 15];
}

}  // namespace qattn::groups
