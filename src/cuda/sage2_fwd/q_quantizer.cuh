// The SA2-8b forward's Q quantizer role: two (or, in the 512-thread shape, four) warps
// of the producer warpgroup turn every item's 16-bit Q tile into the INT8 tile, the Q
// scales, q·c and the V scales of its Q slot (the arithmetic: q_tile.cuh), in item
// order; the first item's tile before the grid-dependency wait (its q·c, which needs c,
// after it).
#pragma once

#include <cstdint>

#include "cuda/common/e4m3.cuh"
#include "cuda/hopper/sync.cuh"
#include "cuda/sage2_fwd/pipeline.cuh"
#include "cuda/sage2_fwd/q_tile.cuh"
#include "cuda/sage2_fwd/traits.cuh"

namespace qattn::sage2 {

// At 24 registers (kLowRegs) nothing but the item ordinal is kept live across a
// quantization: the thread index, the slot and the storage base are derived again where
// used (keep, storage).
// kVarlen: no tile comes before the wait (the items are the plan's), and the rows of a
// tile past its sequence (the next sequence's, as loaded) are zeroed before the
// quantization, so they enter no scale group: the tile is then the one a call on that
// sequence alone quantizes.
template <int D, typename T, int kQuantWarps, int kProducerRegs, bool kVarlen, typename Bar>
__device__ __forceinline__ void q_quantizer(const AttentionParams& p, uint8_t* smem_raw,
                                            uint32_t align_pad, SharedStorage<D>& s, Bar& bar,
                                            bool want_q_dot_c) {
  static_assert(!kVarlen || kQuantWarps == 2, "the varlen kernel has the two-warp quantizer");
  using Tr = KernelTraits<D>;
  using Roles = ProducerRoles<kQuantWarps>;
  constexpr int kQuantFirst = Roles::kQuantFirst, kQuantThreads = Roles::kQuantThreads;
  constexpr bool kLowRegs = kProducerRegs < 40;
  auto keep = [](int x) {
    if constexpr (kLowRegs) return opaque(x);
    return x;
  };
  auto storage = [&]() -> SharedStorage<D>& {
    if constexpr (kLowRegs)
      return *reinterpret_cast<SharedStorage<D>*>(smem_raw + keep(static_cast<int>(align_pad)));
    return s;
  };
  if constexpr (!kVarlen) {
    hopper::mbarrier_wait(&bar.q0_tile, 0);
    if constexpr (kQuantWarps == 4)
      quantize_q_row<D, T>(s.q_in[0], s.q[0], s.side[0].q_scale, threadIdx.x - kQuantFirst,
                           p.granularity, p.scale_log2, bar.block_amax, 0,
                           NamedBarrier::kQuantBlockAmax, NamedBarrier::kQuantBlockAmaxThreads);
    else
      quantize_q_tile<D, T, kLowRegs>(s.q_in[0], s.q[0], s.side[0].q_scale, nullptr, nullptr,
                                      threadIdx.x - kQuantFirst, p.granularity, p.scale_log2,
                                      p.sm_scale);
  }
  hopper::grid_dependency_wait();
  for (int local = 0;; ++local) {
    {
      const int slot = PipelineState<kQSlots<D>>{local}.index(),
                buf = PipelineState<kQinBuffers>{local}.index();
      SharedStorage<D>& st = storage();
      ItemSide<D>& side = st.side[slot];
      // The slot is free once the consumers are done with item local - kQSlots; the
      // 16-bit tile, its side data and the item were loaded into buffer `buf` as soon
      // as that was free, usually long before.
      hopper::mbarrier_wait(&bar.q_empty[slot], PipelineState<kQSlots<D>>{local}.empty_phase());
      hopper::mbarrier_wait(&bar.q_full[buf], PipelineState<kQinBuffers>{local}.phase());
      if (threadIdx.x == kQuantFirst) {  // published by q_ready
        bar.item[slot] = bar.item_in[buf];
        if constexpr (kVarlen) bar.seq[slot] = bar.seq_in[buf];
      }
      if (bar.item_in[buf].m_block < 0) {  // no more work: the consumers learn it from q_ready
        hopper::mbarrier_arrive(&bar.q_ready[slot]);
        break;
      }
      float* q_dot_c = want_q_dot_c ? side.q_dot_c : nullptr;
      const int tid = keep(threadIdx.x - kQuantFirst);
      if constexpr (kVarlen)
        zero_q_rows<D>(st.q_in[buf], tid, bar.seq_in[buf].rows);
      if (!kVarlen && local == 0) {  // quantized before the wait
        if (want_q_dot_c) {
          if constexpr (kQuantWarps == 4)
            q_row_dot_c<D, T>(st.q_in[0], side.q_dot_c, st.side_in[0].k_mean, tid, p.sm_scale);
          else
            q_tile_dot_c<D, T>(st.q_in[0], side.q_dot_c, st.side_in[0].k_mean, tid, p.sm_scale);
        }
      } else if constexpr (kQuantWarps == 4) {
        // q·c after the codes, its pointers derived again: kept live across the
        // quantization they spilled at 24 registers.
        quantize_q_row<D, T>(st.q_in[buf], st.q[slot], side.q_scale, tid, p.granularity,
                             p.scale_log2, bar.block_amax, local & 1, NamedBarrier::kQuantBlockAmax,
                             NamedBarrier::kQuantBlockAmaxThreads);
        if (want_q_dot_c) {
          SharedStorage<D>& st2 = storage();
          const int slot2 = PipelineState<kQSlots<D>>{keep(local)}.index(),
                    buf2 = PipelineState<kQinBuffers>{keep(local)}.index();
          q_row_dot_c<D, T>(st2.q_in[buf2], st2.side[slot2].q_dot_c, st2.side_in[buf2].k_mean,
                            keep(threadIdx.x - kQuantFirst), p.sm_scale);
        }
      } else {
        quantize_q_tile<D, T, kLowRegs>(st.q_in[buf], st.q[slot], side.q_scale, q_dot_c,
                                        want_q_dot_c ? st.side_in[buf].k_mean : nullptr, tid,
                                        p.granularity, p.scale_log2, p.sm_scale);
      }
    }
    const int slot = PipelineState<kQSlots<D>>{keep(local)}.index(),
              buf = PipelineState<kQinBuffers>{keep(local)}.index();
    const int tid = keep(threadIdx.x - kQuantFirst);
    SharedStorage<D>& st = storage();
    ItemSide<D>& side = st.side[slot];
    if (p.q_debug.q_i8 != nullptr) {
      // Read here rather than kept live across the quantization, which would spill at
      // 40 (or 24) registers.
      const SlotItem wd = bar.item_in[buf];
      // the item's 128 rows start at row m_block·128, its 64 scale groups at m_block·64
      const int64_t row0 = static_cast<int64_t>(wd.bh_q) * p.nq_pad + wd.m_block * Tr::kBlockM;
      if constexpr (kQuantWarps == 4)
        copy_q_row_debug<D>(st.q[slot], side.q_scale, want_q_dot_c ? side.q_dot_c : nullptr, tid,
                            p.q_debug, row0, row0 / 2);
      else
        copy_q_tile_debug<D>(st.q[slot], side.q_scale, want_q_dot_c ? side.q_dot_c : nullptr, tid,
                             p.q_debug, row0, row0 / 2);
    }
    // V amax -> V scale (docs/sage2-kernel-arithmetic.md, step 4).
#pragma unroll 1
    for (int ch = tid; ch < D; ch += kQuantThreads)
      side.v_scale[ch] = st.side_in[buf].v_amax[ch] / common::kE4M3Max;
    // The INT8 tile is read by wgmma (async proxy) after the consumers' wait; the
    // buffer will be overwritten by TMA.
    hopper::fence_proxy_async();
    // The buffer (16-bit tile, side data, item) is read: the Q loader may refill it.
    hopper::mbarrier_arrive(&bar.qin_free[buf]);
    hopper::mbarrier_arrive(&bar.q_ready[slot]);
  }
}

}  // namespace qattn::sage2
