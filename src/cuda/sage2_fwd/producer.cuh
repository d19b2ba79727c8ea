// The SA2-8b forward's loads of a work item's 16-bit Q tile (the Q loader: kernel.cuh).
// The loader threads run at 24-40 registers: their loops are rolled, and values are
// derived again where used rather than kept live.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/hopper/tma.cuh"
#include "cuda/sage2_fwd/scheduler.cuh"
#include "cuda/sage2_fwd/traits.cuh"

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

}  // namespace qattn::sage2
