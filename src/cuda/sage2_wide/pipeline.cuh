// The head-dim-256 forward's synchronisation: its mbarriers with their arrival counts,
// the named barriers, each Q slot's work item, and ring positions (docs/sage2-wide-kernel.md).
#pragma once

#include <cstdint>

#include "cuda/hopper/sync.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {

// Position `count` (uses so far) in a ring of N buffers: the buffer, the parity a wait on
// its "full" barrier expects, and that of its "empty" barrier (the first pass over the
// ring waits on the phase before the first, which counts as complete).
template <int N>
struct Ring {
  int count;
  __device__ __forceinline__ int index() const { return count % N; }
  __device__ __forceinline__ uint32_t phase() const { return static_cast<uint32_t>(count / N) & 1; }
  __device__ __forceinline__ uint32_t empty_phase() const { return phase() ^ 1; }
};

// A claimed work item as the loader publishes it in its Q slot.
struct SlotItem {
  int m_block;  // < 0: no more work
  int bh_q;     // b · Hq + hq
  int kv_slice;  // b · Hkv + the KV head
  int kv_len;    // its batch entry's key-padding length (seqlen_kv without one)
};

// Named barriers (0 is __syncthreads): consumer warpgroup cw's 128 threads around its O
// staging, id kOStaged + cw.
struct NamedBarrier {
  static constexpr uint32_t kOStaged = 1, kOStagedThreads = 128;
};

struct Barriers {
  // q_full[s]: the loader (INT8 Q tile and side data, as transaction bytes).
  // q_empty[s]: every consumer thread, after its item's epilogue.
  // k_full / v_full[st] (rings of kKStages and kVStages): the loader. k_empty[st]: lanes
  // 0-3 of each consumer warp (the
  // ones that read the stage's K scales); v_empty[st]: lane 0 of each consumer warp.
  static constexpr uint32_t kQFullArrivals = 1, kQEmptyArrivals = kConsumerThreads;
  static constexpr uint32_t kKFullArrivals = 1, kVFullArrivals = 1;
  static constexpr uint32_t kKEmptyArrivals = 4 * kConsumerWarps, kVEmptyArrivals = kConsumerWarps;

  SlotItem item[kQSlots];
  uint64_t q_full[kQSlots], q_empty[kQSlots];
  uint64_t k_full[kKStages], k_empty[kKStages], v_full[kVStages], v_empty[kVStages];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kQSlots; ++i) {
      hopper::mbarrier_init(&q_full[i], kQFullArrivals);
      hopper::mbarrier_init(&q_empty[i], kQEmptyArrivals);
    }
#pragma unroll
    for (int i = 0; i < kKStages; ++i) {
      hopper::mbarrier_init(&k_full[i], kKFullArrivals);
      hopper::mbarrier_init(&k_empty[i], kKEmptyArrivals);
    }
#pragma unroll
    for (int i = 0; i < kVStages; ++i) {
      hopper::mbarrier_init(&v_full[i], kVFullArrivals);
      hopper::mbarrier_init(&v_empty[i], kVEmptyArrivals);
    }
    hopper::fence_barrier_init();
  }
};

}  // namespace qattn::sage2_wide
