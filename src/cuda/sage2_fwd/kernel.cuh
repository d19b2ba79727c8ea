// SageAttention2-8b forward on sm_90a: INT8 Q·Kᵀ and E4M3 P·V on wgmma, TMA loads
// into a ring of shared-memory stages, two-level accumulation.
//
// CTA = 3 warpgroups and 128 query rows. Warpgroup 0 is the producer: one thread
// issues TMA loads of K and Vᵀ tiles into kStages stages guarded by "full" (TMA
// transaction bytes) and "empty" (consumers done) mbarriers, another claims the work
// items and loads each one's 16-bit Q tile, and two warps quantize it to INT8 in shared memory
// (q_tile.cuh). Warpgroups 1 and 2 are consumers, 64 query rows each; registers move to
// them with setmaxnreg. The four-warp shape (kQuantWarps = 4) adds a fourth warpgroup for
// the two loaders, and all of warpgroup 0 quantizes. Every role and barrier:
// docs/sage2-kernel-pipeline.md.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/hopper/sync.cuh"
#include "cuda/hopper/tma.cuh"
#include "cuda/hopper/wgmma.cuh"
#include "cuda/sage2_fwd/epilogue.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/common/mask.cuh"
#include "cuda/sage2_fwd/q_tile.cuh"
#include "cuda/sage2_fwd/softmax.cuh"
#include "cuda/common/work_order.h"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {

struct AttentionParams {
  const float* k_scale;  // (B, Hkv, nkv_pad / 128 * 4)
  const float* k_mean;   // (B, Hkv, D): the K smoothing vector c (for q·c in the LSE)
  const float* v_amax;   // (B, Hkv, D): V scale = amax / 448
  QDebugOut q_debug;     // null in production
  float scale_log2, sm_scale;
  qattn_qk_granularity granularity;
  void* o;  // the caller's O; written by TMA (tensor map) up to column o_tma_cols, and
            // directly from then to head_dim (a partial 16-byte chunk; head_dim % 8 != 0)
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int o_tma_cols;
  float* lse;  // (B, Hq, Nq) or null
  int heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, nq_pad, nkv_pad;
  int causal;
  int num_m_blocks;  // nq_pad / 128
  int batch;
  int causal_group;   // causal: query heads per group of the item order (work_order.h)
  int causal_tail;    // causal: blocks per head in the order's tail (work_order.h)
  int* item_counter;  // [0]: items handed out past the first gridDim.x, [1]: CTAs done;
                      // zero at launch, and put back to zero by the last CTA
};

// Registers per thread after setmaxnreg. The CTA can only redistribute what it was
// launched with (168 per thread at 384 threads, 128 at 512): asking for more makes the
// consumers' setmaxnreg.inc wait forever (a hang, not an error). Two splits are compiled: the
// consumers at 232 with the producer warpgroup (loaders and the Q quantizer, rolled
// loops) at 40, or at 240 with the producer at 24. 240 is faster on long items and
// slower on short ones (NOTES v18f); the launch chooses (launch.cu).
// A third shape: 512 threads, where a fourth warpgroup holds the two loaders and all
// four warps of warpgroup 0 quantize Q (one warp per scheduler instead of two of the
// four), each producer warpgroup at 24 with the consumers at 232 (kQuantWarps = 4).
template <int kQuantWarps>
inline constexpr int kCtaThreads = kQuantWarps == 4 ? 512 : 384;
template <int kQuantWarps>
inline constexpr int kLaunchRegs = 65536 / kCtaThreads<kQuantWarps> / 8 * 8;  // 168 or 128
template <int kConsumerRegs, int kQuantWarps = 2>
inline constexpr int kProducerRegsFor =
    (kLaunchRegs<kQuantWarps> * kCtaThreads<kQuantWarps> - kConsumerRegs * 256) /
    (kCtaThreads<kQuantWarps> - 256);
static_assert(kProducerRegsFor<232> == 40 && kProducerRegsFor<240> == 24 &&
              kProducerRegsFor<232, 4> == 24);

template <int D>
struct KernelTraits {
  static constexpr int kBlockM = 128, kBlockN = groups::kKvTile;
  static constexpr int kStages = D == 128 ? 3 : 4;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kQBytes = kBlockM * D, kKBytes = kBlockN * D, kVBytes = D * kBlockN;
  // A V stage: the TMA's D rows of Vᵀ, then 8 rows of E4M3 ones whose product columns
  // are P's row sums (NOTES v15c).
  static constexpr int kVOnesRows = 8;
  static constexpr int kVStageBytes = (D + kVOnesRows) * kBlockN;
  static constexpr hopper::Swizzle kQKSwizzle =
      D == 128 ? hopper::Swizzle::k128B : hopper::Swizzle::k64B;
  static constexpr hopper::Swizzle kVSwizzle = hopper::Swizzle::k128B;  // 128 tokens = 128 B
};

// Work item L has Q slot L % kQSlots (its INT8 Q tile, scales, side data and item) and
// 16-bit buffer L % 2 (its Q as loaded; later, once quantized, the staging area of item
// L - 1's O). The protocol is written for any kQSlots >= 2.
// Two at d=128: three (the quantizer one more item ahead) measured 0-3% slower there
// (NOTES v13e, v18d). Three at d=64: causal shapes gain 1-7% end-to-end, the others are
// even (v18e).
template <int D>
inline constexpr int kQSlots = D == 64 ? 3 : 2;
inline constexpr int kQinBuffers = 2;

// The small per-item data in shared memory, so no consumer waits on a global load at
// the start or the end of an item (NOTES v10). V amax and c are bulk-copied with the Q
// tile into its 16-bit buffer's QInSide; the quantizer turns them into the Q slot's
// ItemSide with the Q scales and q·c.
template <int D>
struct QInSide {
  float v_amax[D];  // the KV head's per-channel V amax
  float k_mean[D];  // c of the KV head
};
template <int D>
struct ItemSide {
  float q_scale[2 * groups::kQThreadGroupsPerBlock];  // the 128 rows' Q scale groups
  float q_dot_c[128];                                 // q·c per row (LSE correction)
  // The per-channel V scale, amax / 448, divided by the quantizer so the consumers'
  // epilogue does no division (NOTES v14e).
  float v_scale[D];
};

// A claimed work item as the Q loader publishes it in its Q slot, decoded once for all
// roles.
struct SlotItem {
  int m_block;  // < 0: no more work
  int bh_q;     // b · Hq + hq
  int kv_slice, n_tiles;
};

template <int D>
struct SharedStorage {
  using Tr = KernelTraits<D>;
  alignas(1024) uint8_t q_in[kQinBuffers][QTileLayout<D>::kInBytes];  // 16-bit, as loaded
  alignas(1024) uint8_t q[kQSlots<D>][Tr::kQBytes];                   // INT8, wgmma layout
  alignas(1024) uint8_t k[Tr::kStages][Tr::kKBytes];
  alignas(1024) uint8_t v[Tr::kStages][Tr::kVStageBytes];
  alignas(16) ItemSide<D> side[kQSlots<D>];
  alignas(16) float k_scale[Tr::kStages][groups::kKThreadGroupsPerTile];  // with its K tile
  alignas(16) QInSide<D> side_in[kQinBuffers];  // last: the consumers' offsets stay as before
};

// The pipeline's mbarriers and each Q slot's work item, in static shared memory: every
// role addresses them by constants. Reached through the generic SharedStorage pointer,
// their addresses kept registers live that spilled the 40-register producers and the
// consumers.
template <int D, int kStages>
struct Pipeline {
  SlotItem item[kQSlots<D>];      // the work item of each Q slot (the quantizer's copy)
  SlotItem item_in[kQinBuffers];  // and of each 16-bit buffer (the Q loader's claim)
  uint64_t q_full[kQinBuffers], qin_free[kQinBuffers];
  uint64_t q0_tile;  // the first item's 16-bit Q tile (loaded and quantized before the wait)
  uint64_t q_ready[kQSlots<D>], q_empty[kQSlots<D>];
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  float block_amax[2 * 4];  // the four-warp quantizer's per-block amax (quantize_q_row)
};

// gridDim.x, read where it is used: the producer warpgroup's 40 (or 24) registers cannot keep
// loop invariants live (the compiler would hoist and spill them).
__device__ __forceinline__ int grid_size() {
  int n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return n;
}

// Work items are (128-row query block, query head, batch). The grid is persistent (one
// CTA per SM), so the producer loads the next item's Q and K/V while the consumers still
// finish the current one. CTA i starts with item i and then takes the next unclaimed
// item from a global counter (next_item): a static round-robin gave the CTAs of a causal
// grid sums of block lengths up to 18% apart at N=2K. The order of the items:
// work_order.h.
struct WorkItem {
  int m_block, hq, b;
};
// Two calls, so that the non-causal path never computes B·Hq: this form compiles to the
// measured build's machine code in the consumers (only the producer's registers differ).
__device__ __forceinline__ WorkItem decode_item(const AttentionParams& p, int item) {
  if (!p.causal) {
    const common::ItemPlace at = common::item_place(item, p.num_m_blocks, 0, false, 1, 0);
    return {at.m_block, at.head % p.heads_q, at.head / p.heads_q};
  }
  const common::ItemPlace at =
      common::item_place(item, p.num_m_blocks, p.heads_q * p.batch, true, p.causal_group, p.causal_tail);
  return {at.m_block, at.head % p.heads_q, at.head / p.heads_q};
}
// The Q loader's claim of this CTA's work item number `local` (one thread per CTA).
__device__ __forceinline__ int next_item(const AttentionParams& p, int local) {
  return local == 0 ? static_cast<int>(blockIdx.x) : grid_size() + atomicAdd(&p.item_counter[0], 1);
}

// Called by each CTA's Q loader after its last claim: the last CTA to get here puts the
// counters back to zero for the next launch (every claim of the grid is done by then).
__device__ __forceinline__ void release_item_counter(const AttentionParams& p) {
  __threadfence();  // this CTA's last claim comes before its count
  if (atomicAdd(&p.item_counter[1], 1) == grid_size() - 1) {
    p.item_counter[0] = 0;
    p.item_counter[1] = 0;
  }
}

// b · Hkv + the KV head that query head hq reads (GQA: Hq / Hkv query heads per KV head).
__device__ __forceinline__ int kv_slice_of(const AttentionParams& p, const WorkItem& w) {
  return w.b * p.heads_kv + w.hq / (p.heads_q / p.heads_kv);
}

// The consumers' view of the storage (same bytes as the producers'). At d = 64 it is
// reached through an integer (generic) address, as before v13: ptxas then schedules the
// consumer loop differently (the P·V wait after more of the softmax) and the kernel ran
// 11-13% faster at N = 8K-32K than with shared-space accesses; at d = 128 shared-space
// accesses were 1-4% faster (NOTES v13d). A measured code-generation choice.
template <int D>
__device__ __forceinline__ SharedStorage<D>& consumer_storage(uint8_t* smem_raw,
                                                              SharedStorage<D>& shared_view) {
  if constexpr (D == 64)
    return *reinterpret_cast<SharedStorage<D>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                ~uintptr_t{1023});
  else
    return shared_view;
}

// kPolyChunks (d=128 only): the softmax's exps of that many column chunks in each 8 on the
// FMA pipe (numerics::exp2_poly) instead of MUFU; 0 or 1 (launch.cu chooses, NOTES v21f).
template <int D, typename T, int kConsumerRegs, int kQuantWarps = 2, int kPolyChunks = 0>
__global__ void __launch_bounds__(kCtaThreads<kQuantWarps>, 1)
    sage2_fwd_kernel(const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_vt,
                     const __grid_constant__ CUtensorMap tm_o, const AttentionParams p) {
  using Tr = KernelTraits<D>;
  constexpr int kThreads = kCtaThreads<kQuantWarps>;
  constexpr int kProducerRegs = kProducerRegsFor<kConsumerRegs, kQuantWarps>;
  // The producer roles: Q quantizer threads [kQuantFirst, kQuantFirst + kQuantThreads),
  // the K/V loader and the Q loader (one thread each, in other warps).
  constexpr int kQuantThreads = 32 * kQuantWarps;
  constexpr int kQuantFirst = kQuantWarps == 4 ? 0 : 32;
  constexpr int kKvLoader = kQuantWarps == 4 ? 384 : 0;
  constexpr int kQLoader = kQuantWarps == 4 ? 416 : 96;
  extern __shared__ uint8_t smem_raw[];
  // The storage starts at the first 1024-byte boundary (the TMA 128B swizzle). The
  // __shared__ array itself is offset, not an integer address: the compiler then knows
  // every access is to shared memory (LDS/STS, 32-bit addresses) instead of issuing
  // generic loads and stores with 64-bit address arithmetic (the Q quantizer took ~11K
  // cycles per tile with generic ones, NOTES v13c). The consumers: consumer_storage.
  const uint32_t align_pad = (1024u - (hopper::smem_addr(smem_raw) & 1023u)) & 1023u;
  auto& s = *reinterpret_cast<SharedStorage<D>*>(smem_raw + align_pad);
  const int warpgroup = threadIdx.x / 128;
  const int num_items = p.num_m_blocks * p.heads_q * p.batch;
  __shared__ Pipeline<D, Tr::kStages> bar;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kQinBuffers; ++i) {
      hopper::mbarrier_init(&bar.q_full[i], 1);
      if (i == 0) hopper::mbarrier_init(&bar.q0_tile, 1);
      // Phase j of buffer b: the quantizer has read item 2j + b's Q tile (every thread),
      // the K/V loader has read that item, and the two store threads' TMA stores of
      // item 2j + b - 1's O (staged here) have read it.
      hopper::mbarrier_init(&bar.qin_free[i], kQuantThreads + 3);
    }
#pragma unroll
    for (int i = 0; i < kQSlots<D>; ++i) {
      // Every thread arrives on these two (once per item): each thread's own shared-memory
      // writes or reads are then ordered by the barrier itself.
      hopper::mbarrier_init(&bar.q_ready[i], kQuantThreads);
      hopper::mbarrier_init(&bar.q_empty[i], Tr::kConsumerThreads);
    }
#pragma unroll
    for (int i = 0; i < Tr::kStages; ++i) {
      hopper::mbarrier_init(&bar.k_full[i], 1);
      hopper::mbarrier_init(&bar.v_full[i], 1);
      // Lanes 0-3 of each consumer warp arrive: they are the ones that read the stage's
      // K scale (read_k_scale), so their reads are ordered by the barrier itself.
      hopper::mbarrier_init(&bar.k_empty[i], 4 * Tr::kConsumerWarps);
      hopper::mbarrier_init(&bar.v_empty[i], Tr::kConsumerWarps);
    }
    hopper::fence_barrier_init();
  }
  {
    // The ones rows of every V stage (0x38 = E4M3 1.0; equal bytes need no swizzle),
    // written once: the TMA fills only the D rows before them.
    constexpr int kWords = Tr::kVOnesRows * Tr::kBlockN / 4;
    for (int i = threadIdx.x; i < Tr::kStages * kWords; i += kThreads)
      reinterpret_cast<uint32_t*>(s.v[i / kWords] + D * Tr::kBlockN)[i % kWords] = 0x38383838u;
    hopper::fence_proxy_async();  // read by wgmma
  }
  __syncthreads();
  const bool want_q_dot_c = p.lse != nullptr || p.q_debug.q_dot_c != nullptr;
  // Bytes that complete an item's q_full: the 16-bit Q tile, V amax and (for q·c) c.
  const uint32_t q_slot_bytes = QTileLayout<D>::kInBytes + sizeof(QInSide<D>::v_amax) +
                                (want_q_dot_c ? sizeof(QInSide<D>::k_mean) : 0);
  // Loads an item's 16-bit Q tile into a buffer (Q loader).
  auto load_q_tile = [&](int buf, const WorkItem& w, uint64_t* full) {
#pragma unroll
    for (int box = 0; box < D / 64; ++box)
      hopper::tma_load_4d(s.q_in[buf] + box * (Tr::kBlockM * 128), &tm_q, full, box * 64,
                          w.m_block * Tr::kBlockM, w.hq, w.b, hopper::policy_evict_first());
  };
  // The first item's Q is the caller's input, final before this grid could launch (the
  // chain starts with the statistics kernel, launched in stream order), so it is loaded
  // (on q0_tile) and quantized before the grid-dependency wait; the side data of its
  // slot are outputs of the quantization kernels and complete q_full[0] after the wait.
  // Launched early (programmatic dependent launch) while those kernels end, the CTA
  // waits for them only in the roles that read their outputs (the two loaders and the
  // quantizer, before its side data); the consumers read none (NOTES v17f).
  if (threadIdx.x == kQLoader) {
    hopper::tma_prefetch_descriptor(&tm_q);
    hopper::mbarrier_arrive_expect_tx(&bar.q0_tile, QTileLayout<D>::kInBytes);
    load_q_tile(0, decode_item(p, static_cast<int>(blockIdx.x)), &bar.q0_tile);
  }

  if (warpgroup == 0 || (kQuantWarps == 4 && warpgroup == 3)) {
    // ---- producer ------------------------------------------------------------------------
    hopper::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x >= kQuantFirst && threadIdx.x < kQuantFirst + kQuantThreads) {
      // Q tile quantizer: every item of this CTA, in order; the first one's tile before
      // the grid-dependency wait (its q·c, which needs c, after it). At 24 registers
      // (kLowRegs) nothing but the item ordinal is kept live across a quantization: the
      // thread index, the slot and the storage base are derived again where used.
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
      hopper::mbarrier_wait(&bar.q0_tile, 0);
      if constexpr (kQuantWarps == 4)
        quantize_q_row<D, T>(s.q_in[0], s.q[0], s.side[0].q_scale, threadIdx.x - kQuantFirst,
                             p.granularity, p.scale_log2, bar.block_amax, 0);
      else
        quantize_q_tile<D, T, kLowRegs>(s.q_in[0], s.q[0], s.side[0].q_scale, nullptr, nullptr,
                                        threadIdx.x - kQuantFirst, p.granularity, p.scale_log2,
                                        p.sm_scale);
      hopper::grid_dependency_wait();
      for (int local = 0;; ++local) {
        {
          const int slot = local % kQSlots<D>, buf = local % kQinBuffers;
          SharedStorage<D>& st = storage();
          ItemSide<D>& side = st.side[slot];
          // The slot is free once the consumers are done with item local - kQSlots; the
          // 16-bit tile, its side data and the item were loaded into buffer `buf` as soon
          // as that was free, usually long before (NOTES v20a).
          hopper::mbarrier_wait(&bar.q_empty[slot], ((local / kQSlots<D>)&1) ^ 1);
          hopper::mbarrier_wait(&bar.q_full[buf], (local / kQinBuffers) & 1);
          if (threadIdx.x == kQuantFirst)
            bar.item[slot] = bar.item_in[buf];  // published by q_ready
          if (bar.item_in[buf].m_block < 0) {  // no more work: the consumers learn it from q_ready
            hopper::mbarrier_arrive(&bar.q_ready[slot]);
            break;
          }
          float* q_dot_c = want_q_dot_c ? side.q_dot_c : nullptr;
          const int tid = keep(threadIdx.x - kQuantFirst);
          if (local == 0) {  // quantized before the wait
            if (want_q_dot_c) {
              if constexpr (kQuantWarps == 4)
                q_row_dot_c<D, T>(st.q_in[0], side.q_dot_c, st.side_in[0].k_mean, tid, p.sm_scale);
              else
                q_tile_dot_c<D, T>(st.q_in[0], side.q_dot_c, st.side_in[0].k_mean, tid, p.sm_scale);
            }
          } else {
              if constexpr (kQuantWarps == 4) {
                // q·c after the codes, its pointers derived again: kept live across the
                // quantization they spilled at 24 registers.
                quantize_q_row<D, T>(st.q_in[buf], st.q[slot], side.q_scale, tid, p.granularity,
                                     p.scale_log2, bar.block_amax, local & 1);
                if (want_q_dot_c) {
                  SharedStorage<D>& st2 = storage();
                  const int slot2 = keep(local) % kQSlots<D>, buf2 = keep(local) % kQinBuffers;
                  q_row_dot_c<D, T>(st2.q_in[buf2], st2.side[slot2].q_dot_c,
                                    st2.side_in[buf2].k_mean, keep(threadIdx.x - kQuantFirst),
                                    p.sm_scale);
                }
              } else
                quantize_q_tile<D, T, kLowRegs>(st.q_in[buf], st.q[slot], side.q_scale, q_dot_c,
                                                want_q_dot_c ? st.side_in[buf].k_mean : nullptr,
                                                tid, p.granularity, p.scale_log2, p.sm_scale);
          }
        }
        const int slot = keep(local) % kQSlots<D>, buf = keep(local) % kQinBuffers;
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
            copy_q_row_debug<D>(st.q[slot], side.q_scale, want_q_dot_c ? side.q_dot_c : nullptr,
                                tid, p.q_debug, row0, row0 / 2);
          else
            copy_q_tile_debug<D>(st.q[slot], side.q_scale, want_q_dot_c ? side.q_dot_c : nullptr,
                                 tid, p.q_debug, row0, row0 / 2);
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
    // Two loader threads with separate loops, so each fits the warpgroup's registers:
    // kQLoader loads every item's Q tile and side data, kKvLoader the K/V ring.
    // The Q loader also claims the items: it writes each one to its buffer before it
    // arrives on q_full, which the quantizer and the K/V loader wait on (the consumers
    // read the quantizer's copy in the Q slot, through q_ready).
    if (threadIdx.x == kQLoader) {
      hopper::grid_dependency_wait();  // claims read the work counter; side data are outputs
      for (int local = 0;; ++local) {
        const int buf = local % kQinBuffers;
        // Buffer `buf` is free once item local - 2's tile in it is quantized, the K/V
        // loader has read that item (so q_full cannot run a phase ahead of it), and item
        // local - 3's O staged there is stored. The Q slot is not waited for: the load
        // is off the quantizer's path (NOTES v20a).
        if (local >= kQinBuffers)
          hopper::mbarrier_wait(&bar.qin_free[buf], (local / kQinBuffers - 1) & 1);
        const int item = next_item(p, local);
        if (item >= num_items) {
          bar.item_in[buf] = SlotItem{-1, 0, 0, 0};
          hopper::mbarrier_arrive(&bar.q_full[buf]);
          break;
        }
        const WorkItem w = decode_item(p, item);
        const int kv_slice = kv_slice_of(p, w);
        bar.item_in[buf] =
            SlotItem{w.m_block, w.b * p.heads_q + w.hq, kv_slice,
                     common::kv_tiles_for_block(p.seqlen_q, p.seqlen_kv, p.causal != 0, w.m_block)};
        QInSide<D>& side = s.side_in[buf];
        if (local > 0) {
          hopper::mbarrier_arrive_expect_tx(&bar.q_full[buf], q_slot_bytes);
          load_q_tile(buf, w, &bar.q_full[buf]);
        } else {  // its Q came on q0_tile before the wait: here only the side data
          hopper::mbarrier_arrive_expect_tx(&bar.q_full[buf],
                                            q_slot_bytes - QTileLayout<D>::kInBytes);
        }
        hopper::bulk_load(side.v_amax, p.v_amax + static_cast<int64_t>(kv_slice) * D,
                          sizeof(side.v_amax), &bar.q_full[buf]);
        if (want_q_dot_c)
          hopper::bulk_load(side.k_mean, p.k_mean + static_cast<int64_t>(kv_slice) * D,
                            sizeof(side.k_mean), &bar.q_full[buf]);
      }
      release_item_counter(p);
    }
    if (threadIdx.x == kKvLoader) {
      hopper::tma_prefetch_descriptor(&tm_k);
      hopper::tma_prefetch_descriptor(&tm_vt);
      hopper::grid_dependency_wait();  // K, V and the K scales are outputs
      int iter = 0;                    // KV tiles loaded so far: stage and phase of the ring
      for (int local = 0;; ++local) {
        const int buf = local % kQinBuffers;
        hopper::mbarrier_wait(&bar.q_full[buf], (local / kQinBuffers) & 1);
        const SlotItem w = bar.item_in[buf];
        // Read: the buffer's q_full may complete its next phase (item local + 2) only
        // after this, or this loader could miss a phase and wait on the wrong one.
        hopper::mbarrier_arrive(&bar.qin_free[buf]);
        if (w.m_block < 0) break;
        const int kv_slice = w.kv_slice, n_tiles = w.n_tiles;
#pragma unroll 1  // rolled: this warpgroup runs at 40 (or 24) registers
        for (int it = 0; it < n_tiles; ++it, ++iter) {
          // Addressed per tile: a 64-bit pointer kept live across the loop spills at 24.
          const float* k_scale =
              p.k_scale + (static_cast<int64_t>(kv_slice) * (p.nkv_pad / groups::kKvTile) + it) *
                              groups::kKThreadGroupsPerTile;
          const int st = iter % Tr::kStages;
          const uint32_t phase = (iter / Tr::kStages) & 1;
          hopper::mbarrier_wait(&bar.k_empty[st], phase ^ 1);
          hopper::mbarrier_arrive_expect_tx(&bar.k_full[st], Tr::kKBytes + sizeof(s.k_scale[st]));
          // K/V are re-read by every query block of the head: keep them in L2.
          hopper::tma_load_3d(s.k[st], &tm_k, &bar.k_full[st], 0, it * Tr::kBlockN, kv_slice,
                              hopper::policy_evict_last());
          hopper::bulk_load(s.k_scale[st], k_scale, sizeof(s.k_scale[st]), &bar.k_full[st]);
          hopper::mbarrier_wait(&bar.v_empty[st], phase ^ 1);
          hopper::mbarrier_arrive_expect_tx(&bar.v_full[st], Tr::kVBytes);
          hopper::tma_load_3d(s.v[st], &tm_vt, &bar.v_full[st], it * Tr::kBlockN, 0, kv_slice,
                              hopper::policy_evict_last());
        }
      }
    }
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------
  // The consumers run one flat pipeline over (item, tile) pairs: the Q·Kᵀ of the next
  // item's first tile is issued with the P·V of this item's last tile, so the next
  // item's first softmax overlaps that P·V and no item starts or ends with the tensor
  // cores idle (NOTES v10).
  hopper::setmaxnreg_inc<kConsumerRegs>();
  SharedStorage<D>& cs = consumer_storage<D>(smem_raw, s);
  const int cw = warpgroup - 1;  // which 64 rows of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const common::FragCoord fc{lane / 4, lane % 4};
  const common::CausalMask mask{p.seqlen_q, p.seqlen_kv, p.causal != 0};
  constexpr int kS = Tr::kBlockN / 2;  // score elements per thread
  constexpr int kO = D / 2;            // output elements per thread
  constexpr int kOAcc = kO + 4;        // and the ones columns: row sums
  // Independent max chains per row: 4 at d=128, 2 at d=64 (NOTES v8, v12b).
  static_assert(D == 128 || kPolyChunks == 0, "d=64 loses 10-16% with poly exps (NOTES v15d)");
  using Softmax = OnlineSoftmax<kS, D == 64 ? 2 : 4, kPolyChunks>;

  // A work item as a consumer thread sees it.
  struct Item {
    int m_block, bh_q, n_tiles;  // bh_q = b · Hq + hq
    int local;                   // ordinal on this CTA: Q slot and its phase
    int first_iter;              // KV tiles consumed before it: the ring's stage and phase
    int unmasked_until;          // tiles starting after this key need the mask
    __device__ int slot() const { return local % kQSlots<D>; }
    // Where its O is staged: the 16-bit Q buffer of the item after it (quantized by the
    // time the consumers opened that item, which they do before this one's epilogue).
    __device__ int stage_buf() const { return (local + 1) % kQinBuffers; }
    __device__ int stage(int it) const { return (first_iter + it) % Tr::kStages; }
    __device__ uint32_t phase(int it) const {
      return static_cast<uint32_t>((first_iter + it) / Tr::kStages) & 1;
    }
  };
  auto row_in_block = [&](int r) { return cw * 64 + warp * 16 + fc.g + 8 * r; };
  auto row_first = [&](const Item& w) { return w.m_block * Tr::kBlockM + cw * 64; };
  // The epilogue stages the warpgroup's 64 rows of O in its half of a 16-bit Q buffer
  // (stage_buf) and one thread stores them with TMA. The buffer may be refilled only
  // once that store has read it: that thread arrives on qin_free later, in
  // resolve_store() after the next MMA issue, when the read is long done.
  int store_buf = -1;  // the buffer whose qin_free arrival waits for a TMA store (one thread)
  const bool store_thread = threadIdx.x % 128 == 0;
  auto resolve_store = [&] {
    if (store_buf >= 0) {
      hopper::bulk_wait_group_read<0>();
      hopper::mbarrier_arrive(&bar.qin_free[store_buf]);
      store_buf = -1;
    }
  };
  // Buffer 0's first phase has no O before it (qin_free): the store threads arrive for it.
  if (store_thread) hopper::mbarrier_arrive(&bar.qin_free[0]);
  auto write_output = [&](const Item& w, const float(&o)[kO], const Softmax& sm) {
    const ItemSide<D>& side = cs.side[w.slot()];
    resolve_store();
    uint8_t* stage = cs.q_in[w.stage_buf()] + cw * (D / 64) * kOBoxBytes;
    stage_output<T, kO>(o, sm, fc, warp * 16 + fc.g, side.v_scale, stage);
    store_lse(p, sm, fc, w.bh_q, w.m_block * Tr::kBlockM, row_in_block(0), side.q_dot_c);
    hopper::fence_proxy_async();  // the TMA store reads what this thread wrote
    hopper::named_barrier_sync(1 + cw, 128);
    if (p.o_tma_cols < p.head_dim)  // after the barrier: reads other threads' staged rows
      store_output_tail(p, w.bh_q, row_first(w), stage);
    if (store_thread) {
      const int b = w.bh_q / p.heads_q, hq = w.bh_q % p.heads_q;
#pragma unroll
      for (int box = 0; box < D / 64; ++box)
        if (box * 64 < p.o_tma_cols)
          hopper::tma_store_4d(&tm_o, stage + box * kOBoxBytes, box * 64, row_first(w), hq, b);
      hopper::bulk_commit_group();
      store_buf = w.stage_buf();
    }
    // The slot (INT8 Q tile and side data) is free once every thread is done with it.
    hopper::mbarrier_arrive(&bar.q_empty[w.slot()]);
  };

  int next_local = 0, next_iter = 0;
  // d=64: the next item's Q and first K tile were seen ready by the last turn of this one
  // (wait_ahead): open_item and the item's first turn then skip their checks (NOTES
  // v19d: d=64 +1-3%, d=128 0-3% slower).
  bool next_item_ready = false;
  // Opens this CTA's next item that has KV tiles: waits for its Q and side data, and
  // writes the output of items whose rows see no key (O = 0, LSE = -inf) on the way.
  auto open_item = [&](Item& w) -> bool {
    while (true) {
      const int slot = next_local % kQSlots<D>;
      // The Q of this item may need the slot of a store still pending (a 1-tile item
      // has no turn in between to release it): release it before waiting.
      resolve_store();
      if (!next_item_ready) hopper::mbarrier_wait(&bar.q_ready[slot], (next_local / kQSlots<D>)&1);
      const SlotItem si = bar.item[slot];
      const int unmasked_until = mask.unmasked_until(si.m_block * Tr::kBlockM + cw * 64);
      w = Item{si.m_block, si.bh_q, si.n_tiles, next_local, next_iter, unmasked_until};
      ++next_local;
      if (si.m_block < 0 || si.n_tiles > 0) break;
      next_item_ready = false;
      // Rows that see no key: O = 0 and LSE = -inf (rare: causal with Nq > Nkv), with
      // plain stores: nothing is staged, so the store threads release the buffer now.
      write_empty_block(p, si.bh_q, si.m_block * Tr::kBlockM, threadIdx.x - 128,
                        Tr::kConsumerThreads);
      if (store_thread) hopper::mbarrier_arrive(&bar.qin_free[w.stage_buf()]);
      hopper::mbarrier_arrive(&bar.q_empty[slot]);
    }
    next_iter += w.n_tiles;
    return w.m_block >= 0;
  };

  int32_t acc_s[kS];
  uint32_t a_p[kS / 16][4];  // 448·P of the tile whose P·V is next, as E4M3 A fragments
  float alpha[2];            // the O rescale that goes with a_p

  // Callers wait on the stage's "full" barrier first.
  auto issue_qk = [&](const Item& w, int it) {
    const uint64_t desc_q = hopper::make_smem_desc<Tr::kQKSwizzle>(cs.q[w.slot()] + cw * 64 * D);
    const uint64_t desc_k = hopper::make_smem_desc<Tr::kQKSwizzle>(cs.k[w.stage(it)]);
    hopper::wgmma_m64n128k32_s8_ss_init(acc_s, desc_q, desc_k);
#pragma unroll
    for (int kk = 1; kk < D / 32; ++kk)
      hopper::wgmma_m64n128k32_s8_ss(acc_s, hopper::desc_advance(desc_q, kk * 32),
                                     hopper::desc_advance(desc_k, kk * 32));
    hopper::wgmma_commit();
  };
  auto issue_pv = [&](int st, float(&acc_o)[kOAcc]) {
    const uint64_t desc_v = hopper::make_smem_desc<Tr::kVSwizzle>(cs.v[st]);
    if constexpr (D == 128) {
      hopper::wgmma_m64n136k32_e4m3_rs_init(acc_o, a_p[0], desc_v);
#pragma unroll
      for (int kk = 1; kk < Tr::kBlockN / 32; ++kk)
        hopper::wgmma_m64n136k32_e4m3_rs(acc_o, a_p[kk], hopper::desc_advance(desc_v, kk * 32));
    } else {
      hopper::wgmma_m64n72k32_e4m3_rs_init(acc_o, a_p[0], desc_v);
#pragma unroll
      for (int kk = 1; kk < Tr::kBlockN / 32; ++kk)
        hopper::wgmma_m64n72k32_e4m3_rs(acc_o, a_p[kk], hopper::desc_advance(desc_v, kk * 32));
    }
    hopper::wgmma_commit();
  };
  // Scores and online softmax of tile `it` of item w from acc_s (its Q·Kᵀ must be
  // complete); frees its K stage and leaves 448·P in x. qk (tile_scale) is computed by
  // the caller while the MMAs it waits on run.
  auto softmax_tile = [&](const Item& w, int it, float qk, Softmax& sm, float(&x)[kS],
                          float(&alpha_out)[2]) {
    hopper::fence_operands(acc_s);
    if (lane < 4) hopper::mbarrier_arrive(&bar.k_empty[w.stage(it)]);
    const int kv0 = it * Tr::kBlockN;
    // The raw products go to the softmax (OnlineSoftmax::step); masked ones become
    // kMaskedScore in place.
    const bool masked =
        D == 128 ? kv0 > w.unmasked_until : mask.needed(kv0, row_first(w));  // a measured choice
    if (masked) mask.apply(acc_s, fc, kv0, w.m_block * Tr::kBlockM + row_in_block(0));
    sm.step(acc_s, qk, x, alpha_out);
  };

  // q_scale · k_scale of this thread's score groups for tile `it` of item w (in log2
  // units). The K scale group (t = lane % 4) is read by lanes 0-3, which are the ones
  // that arrive on k_empty, and shuffled to the rest. Called right after the tile's
  // Q·Kᵀ is issued: the loads and the shuffle then hide behind the MMAs instead of
  // sitting between the wait and the softmax (3% at N=8K, NOTES v11c).
  // qk > 0 keeps masked (-inf) scores at -inf; an all-zero scale group has all-zero
  // products, so the floor changes nothing. A NaN scale (NaN in Q or K) stays NaN and
  // reaches O through P.
  auto tile_scale = [&](const Item& w, int it) {
    const float ks = lane < 4 ? cs.k_scale[w.stage(it)][lane] : 0.f;
    const float qs = cs.side[w.slot()].q_scale[row_in_block(0) / 16 * 8 + fc.g];
    const float qk = qs * __shfl_sync(0xffffffff, ks, fc.t);
    return qk < FLT_MIN ? FLT_MIN : qk;
  };

  Item cur;
  if (!open_item(cur)) {
    resolve_store();  // items whose rows see no key were written
    return;
  }
  Softmax sm_cur;
  float o[kO];
#pragma unroll
  for (int i = 0; i < kO; ++i) o[i] = 0.f;
  // The next turn's V tile, and its K tile when it is of the same item, checked while this
  // turn's MMAs run: a completed barrier still takes a try_wait round trip (~70 cycles
  // each, NOTES v19c), which at a turn's start delays its MMA issue. The stages stay
  // full until the consumers release them, so the phase checked here holds.
  // d=64, after an item's last K tile: whether the next item's Q and first K tile are
  // there, tested without waiting (w must be the last item opened: next_local, next_iter).
  auto wait_ahead = [&](const Item& w, int it) {
    hopper::mbarrier_wait(&bar.v_full[w.stage(it)], w.phase(it));
    if (it + 1 < w.n_tiles)
      hopper::mbarrier_wait(&bar.k_full[w.stage(it + 1)], w.phase(it + 1));
    else if constexpr (D == 64)
      next_item_ready =
          hopper::mbarrier_test(&bar.q_ready[next_local % kQSlots<D>],
                                (next_local / kQSlots<D>)&1) &&
          hopper::mbarrier_test(&bar.k_full[next_iter % Tr::kStages],
                                (next_iter / Tr::kStages) & 1);
  };
  {  // the pipeline's first tile: nothing to overlap it with yet
    hopper::mbarrier_wait(&bar.k_full[cur.stage(0)], cur.phase(0));
    hopper::wgmma_fence();
    issue_qk(cur, 0);
    const float qk = tile_scale(cur, 0);
    wait_ahead(cur, 0);
    hopper::wgmma_wait<0>();
    float x[kS];
    softmax_tile(cur, 0, qk, sm_cur, x, alpha);
    pack_p_fragments(x, a_p);
  }

  // One round on the tensor cores: P·V of tile `it` of cur and, when there is one, Q·Kᵀ
  // of the next tile (tile it + 1 of cur, or the first tile of the next item). The MMAs
  // are issued on straight-line paths (no branch around a wgmma), which ptxas needs to
  // keep them asynchronous (C7520).
  // V(it) and, within an item, K(nit) were checked by the turn before (wait_ahead); the
  // first K tile of the next item is checked here (new_item).
  auto turn = [&](int it, const Item& nw, int nit, Softmax& sm_next, auto has_next,
                  auto new_item) {
    const int st = cur.stage(it);
    float qk_next = 0.f;
    float acc_o[kOAcc];
    if constexpr (new_item)
      if (!next_item_ready) hopper::mbarrier_wait(&bar.k_full[nw.stage(nit)], nw.phase(nit));
    hopper::wgmma_fence();
    if constexpr (has_next) issue_qk(nw, nit);
    issue_pv(st, acc_o);
    // After the MMAs are issued: the load and shuffle latency hides behind them instead
    // of delaying the issue (3% at N=8K, NOTES v11).
    if constexpr (has_next) qk_next = tile_scale(nw, nit);
    resolve_store();
    if constexpr (has_next) wait_ahead(nw, nit);
    float x[kS], alpha_next[2];
    if constexpr (has_next) {
      // The softmax of the next tile runs while P·V(it) still computes; its P waits in x
      // until P·V(it) has finished reading a_p.
      hopper::wgmma_wait<1>();
      softmax_tile(nw, nit, qk_next, sm_next, x, alpha_next);
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operands(acc_o);
    hopper::fence_operands(a_p);
    __syncwarp();
    if (lane == 0) hopper::mbarrier_arrive(&bar.v_empty[st]);

      // Two-level accumulation: the tile's product landed in fresh registers; one FMA.
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = fmaf(o[i], alpha[(i % 4) / 2], acc_o[i]);
    sm_cur.add_row_sums(acc_o[kO], acc_o[kO + 2], alpha);  // the ones columns (rows g, g + 8)

    if constexpr (has_next) {
      pack_p_fragments(x, a_p);
      alpha[0] = alpha_next[0];
      alpha[1] = alpha_next[1];
    }
  };

  while (true) {
    for (int it = 0; it + 1 < cur.n_tiles; ++it)
      turn(it, cur, it + 1, sm_cur, std::true_type{}, std::false_type{});
    Item nxt;
    Softmax sm_next;
    const bool more = open_item(nxt);
    if (more)
      turn(cur.n_tiles - 1, nxt, 0, sm_next, std::true_type{}, std::true_type{});
    else
      turn(cur.n_tiles - 1, cur, 0, sm_next, std::false_type{}, std::false_type{});
    write_output(cur, o, sm_cur);
    if (!more) {
      // The last stores must have read shared memory before the CTA exits.
      resolve_store();
      break;
    }
    cur = nxt;
    sm_cur = sm_next;
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = 0.f;
  }
}

}  // namespace qattn::sage2
