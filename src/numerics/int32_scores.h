// The raw INT32 scores of the INT8 Q·Kᵀ, as the SA2 kernel's softmax reads them: their
// exact conversion to float, the value that marks a masked score, and which elements of
// a thread's accumulator tile a mask hides. Host and device, so the CPU tests can check
// the properties the kernel relies on (tests/cpu/test_int32_scores.cpp).
#pragma once

#include <cstdint>

#include "numerics/hd.h"

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace qattn::scores {

// |s| <= 128·128·d: the largest product of two INT8 rows of length d <= 128.
inline constexpr int32_t kMaxAbsScore = 128 * 128 * 128;

// INT32 → float without I2F: the bits of 1.5·2²³ + s are the float 1.5·2²³ + s, exact
// for |s| < 2²², and one subtraction removes the offset. I2F shares the ALU pipe with the
// max and the E4M3 packs; an IADD and an FADD go elsewhere (bench/NOTES.md, v12b).
inline constexpr int32_t kMagicBits = 0x4B400000;  // bits of 1.5·2²³
inline constexpr float kMagic = 12582912.f;        // 1.5·2²³

// A masked score: its sum with kMagicBits is the bit pattern of -inf, so it converts to
// -inf with no select, and it is below every real score in an integer max.
inline constexpr int32_t kMaskedScore = static_cast<int32_t>(0xFF800000u - 0x4B400000u);
static_assert(kMaskedScore < -kMaxAbsScore, "kMaskedScore must be below every product");
static_assert(kMaxAbsScore < (1 << 22), "the conversion is exact only below 2^22");

QATTN_HD float score_to_float(int32_t s) {
#if defined(__CUDA_ARCH__)
  // __fsub_rn: no contraction of the offset removal into the caller's FFMA.
  return __fsub_rn(__int_as_float(s + kMagicBits), kMagic);
#else
  return std::bit_cast<float>(s + kMagicBits) - kMagic;
#endif
}

// The last key that query row `row` sees: it sees key j iff j < seqlen_kv and (not
// causal or j <= row + seqlen_kv - seqlen_q); negative when it sees none. Per row the
// visible keys of a tile are a prefix, so the kernel's mask is one compare per element.
QATTN_HD int last_visible_key(int seqlen_q, int seqlen_kv, bool causal, int row) {
  const int last_key = seqlen_kv - 1;
  if (!causal) return last_key;
  const int causal_last = row + (seqlen_kv - seqlen_q);
  return last_key > causal_last ? causal_last : last_key;
}

}  // namespace qattn::scores
