// How the SA2-8b attn_mask pass classifies a 128 × 128 tile of a mask and which tiles a
// query block's list keeps (cuda/sage2_fwd/attn_mask_tiles.cu), as host/device rules so
// the CPU checks them (tests/cpu/test_mask_tiles.cpp).
//
// An additive value is one of: hidden (-inf), saturated (finite and at or below
// kLowestAdditive: bf16's lowest, which transformers writes for "masked"; it enters the
// softmax as kLowestAdditive·log2 e, numerics/additive_mask.h) or live (any other value,
// ±0 included). A tile is
//   hidden     every value hidden;
//   unchanged  every value ±0 (run with nothing read);
//   saturated  every value hidden or saturated, at least one saturated;
//   cut        otherwise (its values are read).
// A saturated tile adds exactly nothing to a row that has a live key elsewhere: that
// key's x exceeds the saturated x = -3.318·10³⁸ by at least FP32's spacing there
// (~2·10³¹), so exp2 of the difference is 0 whichever of them the online softmax meets
// first (met first, the saturated tile's sums are scaled by an alpha of exactly 0). A
// block with an unchanged tile has a live key in every row, so its list leaves the
// saturated tiles out; another block reads them as cut tiles (a row whose every value
// saturates averages its keys, as SDPA's FP32 math does).
#pragma once

#include <cstdint>

#include "numerics/hd.h"

namespace qattn::numerics {

enum MaskTileClass : std::uint8_t {
  kTileHidden = 0,
  kTileUnchanged = 1,  // boolean masks: every key visible
  kTileCut = 2,
  kTileSaturated = 3,  // additive masks only
};

// A bf16 value's bits are saturated (finite, at or below kLowestAdditive): sign set and a
// magnitude from 0x7f2e (2.3129·10³⁸, the first bf16 at or above 2.3·10³⁸) below
// infinity's 0x7f80. An integer test of the bits, the same as the float comparison
// (tests/cpu/test_mask_tiles.cpp runs all 65536 patterns).
QATTN_HD constexpr bool bf16_saturated(std::uint32_t bits) {
  const std::uint32_t mag = bits & 0x7fffu;
  return (bits & 0x8000u) != 0 && mag >= 0x7f2eu && mag < 0x7f80u;
}

// What one additive value shows, as bits of a word the pass ORs over a tile (one
// reduction for all four facts). bits: the value's 16 bits; neg_inf: -inf's in the
// dtype; dead_lo: the lowest pattern that is -inf or saturated (bf16: 0xff2e, so that
// dead_lo <= bits <= neg_inf is "sign set, magnitude 0x7f2e..0x7f80"; fp16, which has no
// saturated value: neg_inf itself).
enum : std::uint32_t {
  kSeenVisible = 1,       // not -inf
  kSeenNonzero = 2,       // not ±0
  kSeenZero = 4,          // ±0
  kSeenLiveNonzero = 8,   // neither -inf, saturated nor ±0
};
QATTN_HD constexpr std::uint32_t additive_value_flags(std::uint32_t bits, std::uint32_t neg_inf,
                                                      std::uint32_t dead_lo) {
  const bool zero = (bits & 0x7fffu) == 0;
  const bool dead = bits - dead_lo <= neg_inf - dead_lo;  // unsigned: a range test
  return (bits != neg_inf ? kSeenVisible : 0u) | (zero ? kSeenZero : kSeenNonzero) |
         (!dead && !zero ? kSeenLiveNonzero : 0u);
}
QATTN_HD constexpr std::uint32_t dead_lo_bits(bool bf16, std::uint32_t neg_inf) {
  return bf16 ? 0xff2eu : neg_inf;
}

// The same facts for two values at once (a 4-byte word of keys c, c + 1; both inside the
// call), ORed into an accumulator by integer steps on both halves together: per half,
// adding 0x7fff to the magnitude sets bit 15 iff it is not 0, adding lo_add iff it is at or
// above dead_lo's magnitude, adding hi_add iff it is above neg_inf's (no carry leaves a
// half: every magnitude is at most 0x7fff). flags() gives what additive_value_flags ORed
// over the values would.
struct AdditiveWordFacts {
  std::uint32_t neg_inf2, lo_add2, hi_add2;
  std::uint32_t differs = 0;          // OR of (word ^ neg_inf2): some value is not -inf
  std::uint32_t nonzero_or = 0;       // OR of the per-half nonzero bits
  std::uint32_t nonzero_and = ~0u;    // AND of them: 0x80008000 unless some value is ±0
  std::uint32_t live_nonzero_or = 0;  // OR of nonzero and not dead

  QATTN_HD constexpr AdditiveWordFacts(std::uint32_t neg_inf, std::uint32_t dead_lo)
      : neg_inf2(neg_inf * 0x10001u),
        lo_add2((0x8000u - (dead_lo & 0x7fffu)) * 0x10001u),
        hi_add2((0x7fffu - (neg_inf & 0x7fffu)) * 0x10001u) {}

  QATTN_HD constexpr void see_word(std::uint32_t w) {
    const std::uint32_t mag = w & 0x7fff7fffu;
    const std::uint32_t nonzero = (mag + 0x7fff7fffu) & 0x80008000u;
    // dead: sign set, magnitude at or above dead_lo's and not above neg_inf's.
    const std::uint32_t dead = w & (mag + lo_add2) & ~(mag + hi_add2) & 0x80008000u;
    differs |= w ^ neg_inf2;
    nonzero_or |= nonzero;
    nonzero_and &= nonzero;
    live_nonzero_or |= nonzero & ~dead;
  }
  QATTN_HD constexpr std::uint32_t flags() const {
    return (differs != 0 ? kSeenVisible : 0u) | (nonzero_or != 0 ? kSeenNonzero : 0u) |
           ((nonzero_and & 0x80008000u) != 0x80008000u ? kSeenZero : 0u) |
           (live_nonzero_or != 0 ? kSeenLiveNonzero : 0u);
  }
};

// The class of an additive tile from what its values showed: a value not -inf, a value
// not ±0, a live value (not -inf and not saturated).
QATTN_HD MaskTileClass additive_tile_class(bool any_visible, bool any_nonzero, bool any_live) {
  if (!any_visible) return kTileHidden;
  if (!any_nonzero) return kTileUnchanged;
  if (!any_live) return kTileSaturated;
  return kTileCut;
}

// Whether the values seen so far make the tile cut whatever the rest holds: a live value
// that is not ±0, or a ±0 beside any value that is not ±0.
QATTN_HD bool additive_cut_proven(bool any_zero, bool any_nonzero, bool any_live_nonzero) {
  return any_live_nonzero || (any_zero && any_nonzero);
}

// Whether a block's list keeps a tile of class c; block_has_unchanged: some tile of the
// block is unchanged (every row has a live key there).
// The same two rules from the ORed flags of additive_value_flags.
QATTN_HD MaskTileClass additive_tile_class(std::uint32_t seen) {
  return additive_tile_class((seen & kSeenVisible) != 0, (seen & kSeenNonzero) != 0,
                             (seen & (kSeenZero | kSeenLiveNonzero)) != 0);
}
QATTN_HD bool additive_cut_proven(std::uint32_t seen) {
  return additive_cut_proven((seen & kSeenZero) != 0, (seen & kSeenNonzero) != 0,
                             (seen & kSeenLiveNonzero) != 0);
}

QATTN_HD bool list_keeps(MaskTileClass c, bool block_has_unchanged) {
  if (c == kTileHidden) return false;
  if (c == kTileSaturated) return !block_has_unchanged;
  return true;
}

// Whether a kept tile's values (or bits) are read: cut tiles, and saturated ones kept.
QATTN_HD bool list_reads(MaskTileClass c) { return c == kTileCut || c == kTileSaturated; }

}  // namespace qattn::numerics
