// Causal (bottom-right aligned) and key-tail masking of a score tile.
// Query i sees key j iff j < Nkv and (not causal or j <= i + Nkv - Nq).
#pragma once

#include <cstdint>

#include "cuda/sage2_fwd/fragment.cuh"
#include "cuda/sage2_fwd/softmax.cuh"

namespace qattn::sage2 {

struct CausalMask {
  int seqlen_q, seqlen_kv;
  bool causal;

  // Whether any element of the tile starting at key kv0, for the 64 rows from row_first,
  // can be masked (so the common, fully visible tiles skip the per-element test).
  __device__ __forceinline__ bool needed(int kv0, int row_first) const {
    if (kv0 + 128 > seqlen_kv) return true;
    return causal && kv0 + 127 > row_first + (seqlen_kv - seqlen_q);
  }

  // Masked raw INT32 products become kMaskedScore (-inf once converted).
  template <int kCols>
  __device__ __forceinline__ void apply(int32_t (&s)[kCols], FragCoord fc, int kv0,
                                        int row0) const {
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int row = row0 + (FragCoord::upper_row(i) ? 8 : 0);
      const int col = kv0 + fc.col(i);
      const bool visible = col < seqlen_kv && (!causal || col <= row + (seqlen_kv - seqlen_q));
      if (!visible) s[i] = kMaskedScore;
    }
  }
};

}  // namespace qattn::sage2
