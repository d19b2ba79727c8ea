// Which work item each persistent CTA of the head-dim-256 forward takes next, and the
// 64-key tiles an item visits. The item order is the SA2-8b forward's
// (common/work_order.h): CTA i starts with item i, then claims from a global counter.
#pragma once

#include "cuda/common/work_order.h"
#include "cuda/sage2_wide/pipeline.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {

struct WorkItem {
  int m_block, hq, b;
};

__device__ __forceinline__ WorkItem decode_item(const WideParams& p, int item) {
  const common::ItemPlace at =
      !p.causal ? common::item_place(item, p.num_m_blocks, 0, false, 1, 0)
                : common::item_place(item, p.num_m_blocks, p.heads_q * p.batch, true,
                                     p.causal_group, p.causal_tail);
  return {at.m_block, at.head % p.heads_q, at.head / p.heads_q};
}

__device__ __forceinline__ int next_item(const WideParams& p, int local) {
  return local == 0 ? static_cast<int>(blockIdx.x)
                    : static_cast<int>(gridDim.x) + atomicAdd(&p.item_counter[0], 1);
}

// After the CTA's last claim: the last CTA puts the counters back to zero.
__device__ __forceinline__ void release_item_counter(const WideParams& p) {
  __threadfence();
  if (atomicAdd(&p.item_counter[1], 1) == static_cast<int>(gridDim.x) - 1) {
    p.item_counter[0] = 0;
    p.item_counter[1] = 0;
  }
}

__device__ __forceinline__ int item_kv_len(const WideParams& p, int b) {
  if (p.kv_lengths == nullptr) return p.seqlen_kv;
  const int n = __ldg(p.kv_lengths + b);
  return n < 0 ? 0 : min(n, p.seqlen_kv);
}

// The 64-key tiles of an item: from the tile of the first key its first row sees to
// that of the last key its last row sees. An item whose rows see no key runs one tile,
// all masked (O = 0, LSE = -inf through l = 0), so no item is empty.
struct TileSpan {
  int first, count;
};
__device__ __forceinline__ TileSpan item_tiles(const WideParams& p, const SlotItem& w) {
  numerics::KeyRule rule = p.keys;
  rule.kv_len = w.kv_len;
  const int first_row = w.m_block * kBlockM;
  const int last_row = min(first_row + kBlockM, p.seqlen_q) - 1;
  const int first_key = rule.first_key(first_row), last_key = rule.last_key(last_row);
  if (last_key < first_key) return {0, 1};
  return {first_key / kBlockN, last_key / kBlockN - first_key / kBlockN + 1};
}

}  // namespace qattn::sage2_wide
