// The SA2-8b forward's two loader roles, one thread each in the producer warpgroup: the
// Q loader (claims the CTA's items, loads each one's 16-bit Q tile and side data) and
// the K/V loader (fills the ring of K and Vᵀ stages). They run at 24-40 registers: their
// loops are rolled, and values are derived again where used rather than kept live.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/common/work_order.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/sage2_fwd/pipeline.cuh"
#include "cuda/sage2_fwd/scheduler.cuh"
#include "cuda/sage2_fwd/traits.cuh"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {

// Bytes that complete an item's q_full: the 16-bit Q tile, V amax and (for q·c) c.
template <int D>
__device__ __forceinline__ uint32_t q_buffer_bytes(bool want_q_dot_c) {
  return QTileLayout<D>::kInBytes + sizeof(QInSide<D>::v_amax) +
         (want_q_dot_c ? sizeof(QInSide<D>::k_mean) : 0);
}

// Loads an item's 16-bit Q tile into buffer `buf`, completing on `full`.
template <int D>
__device__ __forceinline__ void load_q_tile(SharedStorage<D>& s, const CUtensorMap* tm_q, int buf,
                                            const WorkItem& w, uint64_t* full) {
  using Tr = KernelTraits<D>;
#pragma unroll
  for (int box = 0; box < D / 64; ++box)
    hopper::tma_load_4d(s.q_in[buf] + box * (Tr::kBlockM * 128), tm_q, full, box * 64,
                        w.m_block * Tr::kBlockM, w.hq, w.b, hopper::policy_evict_first());
}

// The K/V loader: for each item the Q loader claimed (read from its buffer after
// q_full), the item's K tiles with their scales and its Vᵀ tiles into the ring. It takes
// the three rings, addressed by the caller, rather than the storage: each stage address
// is then the ring's base + stage, as when this loop was in the kernel (with the storage
// the compiler split the offsets otherwise, and scheduled the kernel differently).
template <int D, typename Bar>
__device__ __forceinline__ void kv_loader(const AttentionParams& p,
                                          decltype(SharedStorage<D>::k)& k_stages,
                                          decltype(SharedStorage<D>::k_scale)& k_scales,
                                          decltype(SharedStorage<D>::v)& v_stages, Bar& bar,
                                          const CUtensorMap* tm_k, const CUtensorMap* tm_vt) {
  using Tr = KernelTraits<D>;
  hopper::tma_prefetch_descriptor(tm_k);
  hopper::tma_prefetch_descriptor(tm_vt);
  hopper::grid_dependency_wait();  // K, V and the K scales are outputs
  PipelineState<Tr::kStages> kv{0};  // KV tiles loaded so far: the ring's stage and phase
  for (int local = 0;; ++local) {
    const PipelineState<kQinBuffers> in{local};
    const int buf = in.index();
    hopper::mbarrier_wait(&bar.q_full[buf], in.phase());
    const SlotItem w = bar.item_in[buf];
    // Read: the buffer's q_full may complete its next phase (item local + 2) only
    // after this, or this loader could miss a phase and wait on the wrong one.
    hopper::mbarrier_arrive(&bar.qin_free[buf]);
    if (w.m_block < 0) break;
    const int kv_slice = w.kv_slice, n_tiles = w.n_tiles;
#pragma unroll 1  // rolled: this warpgroup runs at 40 (or 24) registers
    for (int it = 0; it < n_tiles; ++it, kv.advance()) {
      // Addressed per tile: a 64-bit pointer kept live across the loop spills at 24.
      const float* k_scale =
          p.k_scale + (static_cast<int64_t>(kv_slice) * (p.nkv_pad / groups::kKvTile) + it) *
                          groups::kKThreadGroupsPerTile;
      const int st = kv.index();
      hopper::mbarrier_wait(&bar.k_empty[st], kv.empty_phase());
      hopper::mbarrier_arrive_expect_tx(&bar.k_full[st], Tr::kKBytes + sizeof(k_scales[st]));
      // K/V are re-read by every query block of the head: keep them in L2.
      hopper::tma_load_3d(k_stages[st], tm_k, &bar.k_full[st], 0, it * Tr::kBlockN, kv_slice,
                          hopper::policy_evict_last());
      hopper::bulk_load(k_scales[st], k_scale, sizeof(k_scales[st]), &bar.k_full[st]);
      hopper::mbarrier_wait(&bar.v_empty[st], kv.empty_phase());
      hopper::mbarrier_arrive_expect_tx(&bar.v_full[st], Tr::kVBytes);
      hopper::tma_load_3d(v_stages[st], tm_vt, &bar.v_full[st], it * Tr::kBlockN, 0, kv_slice,
                          hopper::policy_evict_last());
    }
  }
}

}  // namespace qattn::sage2
