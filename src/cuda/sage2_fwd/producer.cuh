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

// The varlen kernel's: the block's rows of the packed q from `row` (b = 0; rows past the
// sequence are the next one's, zeroed by the quantizer).
template <int D>
__device__ __forceinline__ void load_q_rows(SharedStorage<D>& s, const CUtensorMap* tm_q, int buf,
                                            int row, int hq, uint64_t* full) {
  using Tr = KernelTraits<D>;
#pragma unroll
  for (int box = 0; box < D / 64; ++box)
    hopper::tma_load_4d(s.q_in[buf] + box * (Tr::kBlockM * 128), tm_q, full, box * 64, row, hq, 0,
                        hopper::policy_evict_first());
}

// The Q loader: claims the CTA's items in order and writes each one to its buffer before
// it arrives on q_full, which the quantizer and the K/V loader wait on (the consumers read
// the quantizer's copy in the Q slot, through q_ready). The first item's Q tile came on
// q0_tile before the grid-dependency wait (kernel.cuh). The side-data buffers come as
// their own array, like kv_loader's rings.
// kVarlen: the items are the plan's (its list is an output of the plan pass, read after
// the wait), and the first item's tile is loaded here like every other.
template <int D, bool kVarlen, typename Bar>
__device__ __forceinline__ void q_loader(const AttentionParams& p, SharedStorage<D>& s,
                                         decltype(SharedStorage<D>::side_in)& side_in, Bar& bar,
                                         const CUtensorMap* tm_q, int num_items, bool want_q_dot_c,
                                         uint32_t q_slot_bytes) {
  hopper::grid_dependency_wait();  // claims read the work counter; side data are outputs
  int entries = 0;
  if constexpr (kVarlen) {
    entries = __ldg(p.varlen.entry_count);
    num_items = entries * p.heads_q;
  }
  for (int local = 0;; ++local) {
    const PipelineState<kQinBuffers> in{local};
    const int buf = in.index();
    // Buffer `buf` is free once item local - 2's tile in it is quantized, the K/V
    // loader has read that item (so q_full cannot run a phase ahead of it), and item
    // local - 3's O staged there is stored. The Q slot is not waited for: the load
    // is off the quantizer's path (measured: bench/NOTES.md).
    if (local >= kQinBuffers) hopper::mbarrier_wait(&bar.qin_free[buf], in.prev_phase());
    const int item = next_item(p, local);
    if (item >= num_items) {
      bar.item_in[buf] = SlotItem{-1, 0, 0, 0};
      hopper::mbarrier_arrive(&bar.q_full[buf]);
      break;
    }
    WorkItem w;
    if constexpr (kVarlen)
      w = decode_varlen_item(p, item, entries);
    else
      w = decode_item(p, item);
    const int kv_slice = kv_slice_of(p, w);
    if constexpr (kVarlen) {
      const SeqPlace sp = p.varlen.seqs[w.b];
      const int row0 = w.m_block * KernelTraits<D>::kBlockM;
      bar.item_in[buf] = SlotItem{w.m_block, w.b * p.heads_q + w.hq, kv_slice, sp.k_len};
      bar.seq_in[buf] = SlotSeq{sp.q_start + row0, sp.q_len - row0, sp.kv_row0,
                                seq_rule(p.keys, sp.q_len, sp.k_len, p.varlen.top_left != 0).offset};
    } else {
      bar.item_in[buf] = SlotItem{w.m_block, w.b * p.heads_q + w.hq, kv_slice, item_kv_len(p, w.b)};
    }
    QInSide<D>& side = side_in[buf];
    if constexpr (kVarlen) {
      hopper::mbarrier_arrive_expect_tx(&bar.q_full[buf], q_slot_bytes);
      load_q_rows<D>(s, tm_q, buf, bar.seq_in[buf].q_row, w.hq, &bar.q_full[buf]);
    } else if (local > 0) {
      hopper::mbarrier_arrive_expect_tx(&bar.q_full[buf], q_slot_bytes);
      load_q_tile<D>(s, tm_q, buf, w, &bar.q_full[buf]);
    } else {  // its Q came on q0_tile before the wait: here only the side data
      hopper::mbarrier_arrive_expect_tx(&bar.q_full[buf], q_slot_bytes - QTileLayout<D>::kInBytes);
    }
    hopper::bulk_load(side.v_amax, p.v_amax + static_cast<int64_t>(kv_slice) * D,
                      sizeof(side.v_amax), &bar.q_full[buf]);
    if (want_q_dot_c)
      hopper::bulk_load(side.k_mean, p.k_mean + static_cast<int64_t>(kv_slice) * D,
                        sizeof(side.k_mean), &bar.q_full[buf]);
  }
  release_item_counter(p);
}

// The K/V loader: for each item the Q loader claimed (read from its buffer after
// q_full), the item's K tiles with their scales and its Vᵀ tiles into the ring.
// It takes the three rings, addressed by the caller, rather than the storage: each stage
// address is then the ring's base + stage, as in the kernel's own code (given the
// storage, the compiler split the offsets otherwise and scheduled the kernel differently).
template <int D, bool kAttnMask, bool kVarlen, typename Bar>
__device__ __forceinline__ void kv_loader(const AttentionParams& p,
                                          decltype(SharedStorage<D>::k)& k_stages,
                                          decltype(SharedStorage<D>::k_scale)& k_scales,
                                          decltype(SharedStorage<D>::v)& v_stages, Bar& bar,
                                          const CUtensorMap* tm_k, const CUtensorMap* tm_vt) {
  using Tr = KernelTraits<D>;
  hopper::tma_prefetch_descriptor(tm_k);
  hopper::tma_prefetch_descriptor(tm_vt);
  hopper::grid_dependency_wait();    // K, V and the K scales are outputs
  PipelineState<Tr::kStages> kv{0};  // KV tiles loaded so far: the ring's stage and phase
  for (int local = 0;; ++local) {
    const PipelineState<kQinBuffers> in{local};
    const int buf = in.index();
    hopper::mbarrier_wait(&bar.q_full[buf], in.phase());
    const SlotItem w = bar.item_in[buf];
    // varlen: the K/V slice is the KV head's, the sequence's tiles start at kv_row0.
    int kv_slice = w.kv_slice, tile0 = 0, q_len = 0;
    if constexpr (kVarlen) {
      kv_slice = w.kv_slice % p.heads_kv;
      tile0 = bar.seq_in[buf].kv_row0 / Tr::kBlockN;
      q_len = bar.seq_in[buf].rows + w.m_block * Tr::kBlockM;
    }
    // Read: the buffer's q_full may complete its next phase (item local + 2) only
    // after this, or this loader could miss a phase and wait on the wrong one.
    hopper::mbarrier_arrive(&bar.qin_free[buf]);
    if (w.m_block < 0) break;
    const common::TileSpan span =
        kVarlen ? varlen_item_tiles(p, w, q_len) : item_tiles<kAttnMask>(p, w);
    const int kv_end = span.first + span.count;
    // kAttnMask: where the item's tile list starts (an int, not a pointer).
    int list_at = 0;
    if constexpr (kAttnMask) {
      const AttnMaskView m = p.mask;  // by value: no address of the kernel parameter
      list_at = m.list_at(w.m_block, w.bh_q) + 1;
    }
#pragma unroll 1  // rolled: this warpgroup runs at 40 (or 24) registers
    for (int i = span.first; i < kv_end; ++i, kv.advance()) {
      // kAttnMask: the tile is entry i of the item's list (loaded before the wait, so
      // its latency hides behind it).
      int it = i + tile0, entry = 0;
      if constexpr (kAttnMask) {
        entry = __ldg(p.mask.tiles + list_at + i);
        it = entry & kMaskTileBits;
      }
      // Addressed per tile: a 64-bit pointer kept live across the loop spills at 24.
      const float* k_scale =
          p.k_scale + (static_cast<int64_t>(kv_slice) * (p.nkv_pad / groups::kKvTile) + it) *
                          groups::kKThreadGroupsPerTile;
      const int st = kv.index();
      hopper::mbarrier_wait(&bar.k_empty[st], kv.empty_phase());
      if constexpr (kAttnMask) bar.tile_entry[st] = entry;  // the consumers read it after k_full
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
