// The SA2-8b forward's synchronisation: every mbarrier and named barrier of the CTA,
// with its arrival count, in one table (Barriers, NamedBarrier), and the position in a
// ring of buffers (PipelineState). docs/sage2-kernel-pipeline.md draws the protocol.
#pragma once

#include <cstdint>

#include "cuda/hopper/sync.cuh"
#include "cuda/sage2_fwd/traits.cuh"

namespace qattn::sage2 {

// Position `count` (the number of uses so far) in a ring of N buffers: the buffer
// index and the parity of the phase that a wait on its barrier expects. Kept as the
// count, from which both are derived where used: the producer roles run at 24-40
// registers and hold one value per ring, and the consumers address the ring at
// item-relative positions (first tile of an item + tile).
template <int N>
struct PipelineState {
  int count;
  __device__ __forceinline__ int index() const { return count % N; }
  // The parity of the phase that completes this use's "full" barrier.
  __device__ __forceinline__ uint32_t phase() const { return static_cast<uint32_t>(count / N) & 1; }
  // The parity of the phase that frees the buffer for this use (its "empty" barrier):
  // the first pass over the ring waits on the phase before the first, which counts as
  // complete.
  __device__ __forceinline__ uint32_t empty_phase() const { return phase() ^ 1; }
  // The parity of the phase of the buffer's previous use (count - N), for count >= N.
  __device__ __forceinline__ uint32_t prev_phase() const {
    return static_cast<uint32_t>(count / N - 1) & 1;
  }
  __device__ __forceinline__ PipelineState operator+(int n) const { return {count + n}; }
  __device__ __forceinline__ void advance() { ++count; }
};

// Named barriers (bar.sync ids; 0 is __syncthreads).
struct NamedBarrier {
  // Consumer warpgroup cw's 128 threads before its TMA store of O: id kOStaged + cw.
  static constexpr uint32_t kOStaged = 1, kOStagedThreads = 128;
  // The four-warp Q quantizer's per-block amax exchange, block b's two warps: id
  // kQuantBlockAmax + b (q_tile.cuh, quantize_q_row).
  static constexpr uint32_t kQuantBlockAmax = 3, kQuantBlockAmaxThreads = 64;
};

// The pipeline's mbarriers and each Q slot's work item, in static shared memory: every
// role addresses them by constants. Reached through the generic SharedStorage pointer,
// their addresses kept registers live that spilled the 40-register producers and the
// consumers.
template <int D, int kQuantWarps>
struct Barriers {
  using Tr = KernelTraits<D>;
  static constexpr int kStages = Tr::kStages;
  static constexpr int kQuantThreads = ProducerRoles<kQuantWarps>::kQuantThreads;

  // Arrival counts. "Full" barriers also wait for the TMA / bulk-copy bytes their one
  // arriving thread announces (arrive_expect_tx).
  // q_full[b]: the Q loader (16-bit Q tile, V amax, c of the buffer's item).
  static constexpr uint32_t kQFullArrivals = 1;
  // q0_tile: the Q loader (the first item's Q tile, loaded before the grid-dependency wait).
  static constexpr uint32_t kQ0TileArrivals = 1;
  // qin_free[b], phase j: the quantizer has read item 2j + b's Q tile (every thread),
  // the K/V loader has read that item, and the two store threads' TMA stores of item
  // 2j + b - 1's O (staged here) have read it.
  static constexpr uint32_t kQinFreeArrivals = kQuantThreads + 3;
  // q_ready[s] (the quantizer) and q_empty[s] (the consumers): every thread arrives
  // (once per item), so each thread's own shared-memory writes or reads are ordered by
  // the barrier itself.
  static constexpr uint32_t kQReadyArrivals = kQuantThreads;
  static constexpr uint32_t kQEmptyArrivals = Tr::kConsumerThreads;
  // k_full / v_full[st]: the K/V loader.
  static constexpr uint32_t kKFullArrivals = 1, kVFullArrivals = 1;
  // k_empty[st]: lanes 0-3 of each consumer warp, the ones that read the stage's K scale
  // (tile_scale), so their reads are ordered by the barrier itself. v_empty[st]: lane 0
  // of each consumer warp.
  static constexpr uint32_t kKEmptyArrivals = 4 * Tr::kConsumerWarps;
  static constexpr uint32_t kVEmptyArrivals = Tr::kConsumerWarps;

  SlotItem item[kQSlots<D>];      // the work item of each Q slot (the quantizer's copy)
  SlotItem item_in[kQinBuffers];  // and of each 16-bit buffer (the Q loader's claim)
  uint64_t q_full[kQinBuffers], qin_free[kQinBuffers];
  uint64_t q0_tile;
  uint64_t q_ready[kQSlots<D>], q_empty[kQSlots<D>];
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  float block_amax[2 * 4];  // the four-warp quantizer's per-block amax (quantize_q_row)
  // With an attn_mask: each K stage's tile-list entry (attn_mask.cuh), written by the K/V
  // loader before the stage's k_full and read by the consumers before its k_empty.
  int tile_entry[kStages];

  // One thread, before the CTA's first __syncthreads.
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kQinBuffers; ++i) {
      hopper::mbarrier_init(&q_full[i], kQFullArrivals);
      if (i == 0) hopper::mbarrier_init(&q0_tile, kQ0TileArrivals);
      hopper::mbarrier_init(&qin_free[i], kQinFreeArrivals);
    }
#pragma unroll
    for (int i = 0; i < kQSlots<D>; ++i) {
      hopper::mbarrier_init(&q_ready[i], kQReadyArrivals);
      hopper::mbarrier_init(&q_empty[i], kQEmptyArrivals);
    }
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      hopper::mbarrier_init(&k_full[i], kKFullArrivals);
      hopper::mbarrier_init(&v_full[i], kVFullArrivals);
      hopper::mbarrier_init(&k_empty[i], kKEmptyArrivals);
      hopper::mbarrier_init(&v_empty[i], kVEmptyArrivals);
    }
    hopper::fence_barrier_init();
  }
};

// The varlen kernel's: also each item's sequence, beside its SlotItem (after the
// others, so the dense kernels' layout is unchanged).
template <int D, int kQuantWarps>
struct VarlenBarriers : Barriers<D, kQuantWarps> {
  SlotSeq seq[kQSlots<D>];
  SlotSeq seq_in[kQinBuffers];
};

}  // namespace qattn::sage2
