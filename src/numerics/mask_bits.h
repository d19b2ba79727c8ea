// A boolean attn_mask row of a 128-key tile as the SA2-8b consumers read it: four words,
// one per fragment column group t = 0..3, with key 8j + 2t + e of the tile at bit
// 2j + e (the 32 keys a consumer thread holds of the row). The tile pass forms them from
// the row's 4-byte words, lane l of a warp holding keys 4l .. 4l + 3 (one byte each, not
// 0 = visible): each lane contributes lane_group_bits to every group's word and an OR
// across the warp (redux.or) gives the word.
#pragma once

#include "numerics/hd.h"

namespace qattn::numerics {

// Bit 8b set where byte b of x is not 0 (a carry-free test of each byte).
QATTN_HD constexpr unsigned visible_bytes(unsigned x) {
  return ((((x & 0x7f7f7f7fu) + 0x7f7f7f7fu) | x) >> 7) & 0x01010101u;
}

// Lane l's share of column group t's word, from visible_bytes of its keys 4l .. 4l + 3.
// Key 8j + 2t + e is byte 2 (t % 2) + e of lane 2j + t / 2: the lane's bytes 0, 1 belong
// to group 2 (l % 2), bytes 2, 3 to group 2 (l % 2) + 1, at bits 2j, 2j + 1 (j = l / 2).
QATTN_HD constexpr unsigned lane_group_bits(unsigned visible, int lane, int t) {
  const unsigned pair = t % 2 == 0 ? (visible & 1u) | ((visible >> 7) & 2u)
                                   : ((visible >> 16) & 1u) | ((visible >> 23) & 2u);
  return lane % 2 == t / 2 ? pair << (2 * (lane / 2)) : 0u;
}

}  // namespace qattn::numerics
