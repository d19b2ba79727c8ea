// Masking of a 128-key score tile by the rule of numerics/key_range.h: causal, sliding
// window and key padding, either alignment. Per row the visible keys are one interval
// [first, last], so the kernel skips the tiles outside every row's interval (the
// loaders never fetch them), runs the tiles inside every row's interval without a test,
// and tests elements only in the few tiles that cut an interval: two compares per
// element against per-row limits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/fragment.cuh"
#include "numerics/int32_scores.h"
#include "numerics/key_range.h"
#include "numerics/mma_groups.h"

namespace qattn::common {

struct KeyMask {
  numerics::KeyRule rule;  // of one work item (its batch entry's key-padding length)

  // For the 64 rows from row_first: tiles that start after this key can have masked
  // elements (the first row sees the fewest keys at the end); the others, the common
  // case, skip the per-element test.
  __device__ __forceinline__ int unmasked_until(int row_first) const {
    return rule.last_key(row_first) - (groups::kKvTile - 1);
  }
  // And tiles that start before this key (the last row's window starts latest).
  __device__ __forceinline__ int unmasked_from(int row_first) const {
    return rule.first_key(row_first + groups::kQBlock - 1);
  }
  // Both tests for one tile, written out. The d=64 kernel evaluates them per tile: ptxas
  // then schedules its loop 5-8% faster than with per-item thresholds, which make d=128
  // 2% faster (measured: bench/NOTES.md).
  __device__ __forceinline__ bool needed(int kv0, int row_first) const {
    return kv0 > unmasked_until(row_first) || kv0 < unmasked_from(row_first);
  }

  // Masked scores become `masked`: raw INT32 products kMaskedScore (-inf once
  // converted), FP32 scores (the 16-bit forward) -inf. Per row the visible elements are
  // an interval, so two limits per row and two compares against a constant column
  // offset per element decide it (row0: the thread's upper row).
  template <typename S, int kCols>
  __device__ __forceinline__ void apply(S (&s)[kCols], FragCoord fc, int kv0, int row0) const {
    const S masked = std::is_same_v<S, float> ? S(-INFINITY) : S(scores::kMaskedScore);
    int hi[2], lo[2];  // rows g, g + 8
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      hi[r] = rule.last_key(row0 + 8 * r) - kv0 - 2 * fc.t;
      lo[r] = rule.first_key(row0 + 8 * r) - kv0 - 2 * fc.t;
    }
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int col = 8 * (i / 4) + (i % 2), r = FragCoord::upper_row(i) ? 1 : 0;
      if (col > hi[r] || col < lo[r]) s[i] = masked;
    }
  }
};

}  // namespace qattn::common
