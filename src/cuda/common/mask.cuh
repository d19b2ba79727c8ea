// Causal (bottom-right aligned) and key-tail masking of a 128-key score tile.
// Query i sees key j iff j < Nkv and (not causal or j <= i + Nkv - Nq).
#pragma once

#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"

namespace qattn::common {

struct CausalMask {
  int seqlen_q, seqlen_kv;
  bool causal;

  // For the 64 rows from row_first: tiles that start after this key can have masked
  // elements (the first row sees the fewest keys); the others, the common case, skip
  // the per-element test.
  __device__ __forceinline__ int unmasked_until(int row_first) const {
    return scores::last_visible_key(seqlen_q, seqlen_kv, causal, row_first) - (groups::kKvTile - 1);
  }
  // The same test for one tile, kv0 > unmasked_until(row_first), written out. The d=64
  // kernel evaluates it per tile: ptxas then schedules its loop 5-8% faster than with the
  // per-item threshold, which makes d=128 2% faster (measured: bench/NOTES.md).
  __device__ __forceinline__ bool needed(int kv0, int row_first) const {
    if (kv0 + groups::kKvTile > seqlen_kv) return true;
    return causal && kv0 + (groups::kKvTile - 1) > row_first + (seqlen_kv - seqlen_q);
  }

  // Masked raw INT32 products become kMaskedScore (-inf once converted). Per row the
  // visible elements are a prefix (scores::last_visible_key), so one limit per row
  // and one compare against a constant column offset per element decide it (row0: the
  // thread's upper row).
  template <int kCols>
  __device__ __forceinline__ void apply(int32_t (&s)[kCols], FragCoord fc, int kv0,
                                        int row0) const {
    int lim[2];  // rows g, g + 8
#pragma unroll
    for (int r = 0; r < 2; ++r)
      lim[r] = scores::last_visible_key(seqlen_q, seqlen_kv, causal, row0 + 8 * r) - kv0 - 2 * fc.t;
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      if (8 * (i / 4) + (i % 2) > lim[FragCoord::upper_row(i) ? 1 : 0]) s[i] = scores::kMaskedScore;
  }
};

}  // namespace qattn::common
