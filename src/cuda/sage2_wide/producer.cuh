// The head-dim-256 forward's loader: one thread of the producer warpgroup claims the
// CTA's items, loads each one's INT8 Q tile and side data into its Q slot, then the
// item's K tiles (with their scales) and Vᵀ tiles into the ring. Q of the next item is
// loaded once this item's K/V loads are issued: the rings are two (K) and three (V)
// tiles deep, so it lands while the consumers still have this item's last tiles to run.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/sage2_wide/pipeline.cuh"
#include "cuda/sage2_wide/scheduler.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {

// kV: the rows of Vᵀ (V's channels) the variant multiplies; the Vᵀ tensor map's box has
// as many.
template <int kV>
__device__ __forceinline__ void loader(const WideParams& p, SharedStorage& s, Barriers& bar,
                                       const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                       const CUtensorMap* tm_vt) {
  hopper::tma_prefetch_descriptor(tm_q);
  hopper::tma_prefetch_descriptor(tm_k);
  hopper::tma_prefetch_descriptor(tm_vt);
  hopper::grid_dependency_wait();  // every input of this kernel is an output of the passes
  const int num_items = p.num_m_blocks * p.heads_q * p.batch;
  const bool want_lse = p.lse != nullptr;
  const uint32_t q_bytes = 2 * kQHalfBytes + sizeof(ItemSide::q_scale) + sizeof(ItemSide::v_amax) +
                           (want_lse ? sizeof(ItemSide::q_dot_c) : 0);
  int tiles = 0;  // KV tiles loaded so far: both rings' position
  for (int local = 0;; ++local) {
    const Ring<kQSlots> q{local};
    const int slot = q.index();
    hopper::mbarrier_wait(&bar.q_empty[slot], q.empty_phase());
    const int item = next_item(p, local);
    if (item >= num_items) {
      bar.item[slot] = SlotItem{-1, 0, 0, 0};
      hopper::mbarrier_arrive(&bar.q_full[slot]);
      break;
    }
    const WorkItem w = decode_item(p, item);
    const int bh_q = w.b * p.heads_q + w.hq;
    const int kv_slice = w.b * p.heads_kv + w.hq / (p.heads_q / p.heads_kv);
    const SlotItem si{w.m_block, bh_q, kv_slice, item_kv_len(p, w.b)};
    bar.item[slot] = si;
    hopper::mbarrier_arrive_expect_tx(&bar.q_full[slot], q_bytes);
#pragma unroll
    for (int half = 0; half < 2; ++half)
      hopper::tma_load_3d(s.q[slot] + half * kQHalfBytes, tm_q, &bar.q_full[slot],
                          half * kHalfBytes, w.m_block * kBlockM, bh_q,
                          hopper::policy_evict_first());
    ItemSide& side = s.side[slot];
    hopper::bulk_load(side.q_scale,
                      p.q_scale + static_cast<int64_t>(bh_q) * (p.nq_pad / groups::kQBlock) *
                                      groups::kQThreadGroupsPerBlock +
                          w.m_block * (2 * groups::kQThreadGroupsPerBlock),
                      sizeof(side.q_scale), &bar.q_full[slot]);
    hopper::bulk_load(side.v_amax, p.v_amax + static_cast<int64_t>(kv_slice) * kD,
                      sizeof(side.v_amax), &bar.q_full[slot]);
    if (want_lse)
      hopper::bulk_load(side.q_dot_c,
                        p.q_dot_c + static_cast<int64_t>(bh_q) * p.nq_pad + w.m_block * kBlockM,
                        sizeof(side.q_dot_c), &bar.q_full[slot]);

    const TileSpan span = item_tiles(p, si);
#pragma unroll 1
    for (int i = span.first; i < span.first + span.count; ++i, ++tiles) {
      const Ring<kKStages> kr{tiles};
      const int st = kr.index();
      hopper::mbarrier_wait(&bar.k_empty[st], kr.empty_phase());
      hopper::mbarrier_arrive_expect_tx(&bar.k_full[st], 2 * kKHalfBytes + sizeof(s.k_scale[st]));
      // K/V are re-read by every query block of the head: keep them in L2.
#pragma unroll
      for (int half = 0; half < 2; ++half)
        hopper::tma_load_3d(s.k[st] + half * kKHalfBytes, tm_k, &bar.k_full[st], half * kHalfBytes,
                            i * kBlockN, kv_slice, hopper::policy_evict_last());
      // The scales of the 128-key tile this 64-key tile is half of.
      hopper::bulk_load(s.k_scale[st],
                        p.k_scale + (static_cast<int64_t>(kv_slice) * (p.nkv_pad / groups::kKvTile) +
                                     i / (groups::kKvTile / kBlockN)) *
                                        groups::kKThreadGroupsPerTile,
                        sizeof(s.k_scale[st]), &bar.k_full[st]);
      const Ring<kVStages> vr{tiles};
      const int sv = vr.index();
      hopper::mbarrier_wait(&bar.v_empty[sv], vr.empty_phase());
      hopper::mbarrier_arrive_expect_tx(&bar.v_full[sv], kV * kVRowBytes);
      hopper::tma_load_3d(s.v[sv], tm_vt, &bar.v_full[sv], i * kBlockN, 0, kv_slice,
                          hopper::policy_evict_last());
    }
  }
  release_item_counter(p);
}

}  // namespace qattn::sage2_wide
