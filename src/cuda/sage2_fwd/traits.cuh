// The SA2-8b forward kernel's shapes and shared memory: the parameters it is launched
// with, the CTA shape and register split, the tile sizes, the ring depths and the layout
// of dynamic shared memory (docs/sage2-kernel-pipeline.md).
#pragma once

#include <cstdint>

#include "cuda/common/work_order.h"
#include "cuda/hopper/swizzle.h"
#include "cuda/sage2_fwd/attn_mask.cuh"
#include "cuda/sage2_fwd/q_tile.cuh"
#include "cuda/sage2_fwd/varlen.cuh"
#include "numerics/key_range.h"
#include "numerics/mma_groups.h"
#include "qattn/qattn.h"

namespace qattn::sage2 {

struct AttentionParams {
  const float* k_scale;  // (B, Hkv, nkv_pad / 128 * 4)
  const float* k_mean;   // (B, Hkv, D): the K smoothing vector c (for q·c in the LSE)
  const float* v_amax;   // (B, Hkv, D): V scale = amax / 448
  QDebugOut q_debug;     // null in production
  float scale_log2, sm_scale;
  qattn_qk_granularity granularity;
  void* o;  // the caller's O; written by TMA (tensor map) up to column o_tma_cols, and
            // directly from then to head_dim_v (a partial 16-byte chunk; head_dim_v % 8 != 0)
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int o_tma_cols;
  float* lse;  // (B, Hq, Nq) or null
  float* p_max;  // (B, Hq, Nq) or null: each row's largest P, exp2(m − lse2) (qattn.h)
  int heads_q, heads_kv, seqlen_q, seqlen_kv;
  int head_dim_v;  // O's columns: V's head dim (Q·K's may be larger)
  int nq_pad, nkv_pad;
  int causal;  // the item order's (work_order.h); which keys a row sees is `keys`
  // Which keys each row sees (numerics/key_range.h): the call's rule, with kv_len =
  // seqlen_kv; where kv_lengths (the caller's key-padding lengths, B ints) is given, the
  // Q loader reads each item's length and publishes it with the item (SlotItem).
  numerics::KeyRule keys;
  const int* kv_lengths;
  int num_m_blocks;  // nq_pad / 128
  int batch;
  int causal_group;   // causal: query heads per group of the item order (work_order.h)
  int causal_tail;    // causal: blocks per head in the order's tail (work_order.h)
  int* item_counter;  // [0]: items handed out past the first gridDim.x, [1]: CTAs done;
                      // zero at launch, and put back to zero by the last CTA
  AttnMaskView mask;  // a boolean attn_mask's tile lists (mask.tiles null without one)
  // A packed batch (varlen.cuh): the plan; b is then the sequence, m_block its query
  // block, and keys holds the call's window sides (each item's offset and kv_len are
  // its sequence's).
  VarlenView varlen;
};

// Registers per thread after setmaxnreg. The CTA can only redistribute what it was
// launched with (168 per thread at 384 threads, 128 at 512): asking for more makes the
// consumers' setmaxnreg.inc wait forever (a hang, not an error). Two splits are compiled: the
// consumers at 232 with the producer warpgroup (loaders and the Q quantizer, rolled
// loops) at 40, or at 240 with the producer at 24. 240 is faster on long items and
// slower on short ones (measured: bench/NOTES.md); the launch chooses (launch.cu).
// A third shape: 512 threads, where a fourth warpgroup holds the two loaders and all
// four warps of warpgroup 0 quantize Q (one warp per scheduler instead of two of the
// four), each producer warpgroup at 24 with the consumers at 232 (kQuantWarps = 4).
template <int kQuantWarps>
inline constexpr int kCtaThreads = kQuantWarps == 4 ? 512 : 384;
template <int kQuantWarps>
inline constexpr int kLaunchRegs = 65536 / kCtaThreads<kQuantWarps> / 8 * 8;  // 168 or 128
template <int kConsumerRegs, int kQuantWarps = 2>
inline constexpr int kProducerRegsFor = (kLaunchRegs<kQuantWarps> * kCtaThreads<kQuantWarps> -
                                         kConsumerRegs * 256) /
                                        (kCtaThreads<kQuantWarps> - 256);
static_assert(kProducerRegsFor<232> == 40 && kProducerRegsFor<240> == 24 &&
              kProducerRegsFor<232, 4> == 24);

// The producer warpgroup's roles (threads of the CTA): the Q quantizer's threads
// [kQuantFirst, kQuantFirst + kQuantThreads), and the K/V loader and the Q loader (one
// thread each, in other warps).
template <int kQuantWarps>
struct ProducerRoles {
  static constexpr int kQuantThreads = 32 * kQuantWarps;
  static constexpr int kQuantFirst = kQuantWarps == 4 ? 0 : 32;
  static constexpr int kKvLoader = kQuantWarps == 4 ? 384 : 0;
  static constexpr int kQLoader = kQuantWarps == 4 ? 416 : 96;
};

template <int D>
struct KernelTraits {
  static constexpr int kBlockM = common::kItemRows, kBlockN = groups::kKvTile;
  static constexpr int kStages = D == 128 ? 3 : 4;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kQBytes = kBlockM * D, kKBytes = kBlockN * D, kVBytes = D * kBlockN;
  // A V stage: the TMA's D rows of Vᵀ, then 8 rows of E4M3 ones whose product columns
  // are P's row sums.
  static constexpr int kVOnesRows = 8;
  static constexpr int kVStageBytes = (D + kVOnesRows) * kBlockN;
  // The swizzle of the K (and INT8 Q) and of the Vᵀ tiles: the tensor maps (launch.cu)
  // and the wgmma descriptors (mainloop.cuh) both take it from here.
  static constexpr hopper::Swizzle kQKSwizzle =
      D == 128 ? hopper::Swizzle::k128B : hopper::Swizzle::k64B;
  static constexpr hopper::Swizzle kVSwizzle = hopper::Swizzle::k128B;  // 128 tokens = 128 B
  static_assert(hopper::swizzle_bytes(kQKSwizzle) == D &&
                hopper::swizzle_bytes(kVSwizzle) == kBlockN);
};

// Work item L has Q slot L % kQSlots (its INT8 Q tile, scales, side data and item) and
// 16-bit buffer L % 2 (its Q as loaded; later, once quantized, the staging area of item
// L - 1's O). The protocol is written for any kQSlots >= 2.
// Two at d=128: three (the quantizer one more item ahead) measured 0-3% slower there.
// Three at d=64: causal shapes gain 1-7% end-to-end, the others are even.
template <int D>
inline constexpr int kQSlots = D == 64 ? 3 : 2;
inline constexpr int kQinBuffers = 2;

// The small per-item data in shared memory, so no consumer waits on a global load at
// the start or the end of an item. V amax and c are bulk-copied with the Q tile into
// its 16-bit buffer's QInSide; the quantizer turns them into the Q slot's ItemSide with
// the Q scales and q·c.
template <int D>
struct QInSide {
  float v_amax[D];  // the KV head's per-channel V amax
  float k_mean[D];  // c of the KV head
};
template <int D>
struct ItemSide {
  float q_scale[2 * groups::kQThreadGroupsPerBlock];  // the 128 rows' Q scale groups
  float q_dot_c[common::kItemRows];                   // q·c per row (LSE correction)
  // The per-channel V scale, amax / 448, divided by the quantizer so the consumers'
  // epilogue does no division.
  float v_scale[D];
};

// A claimed work item as the Q loader publishes it in its Q slot, decoded once for all
// roles. Its KV tiles (item_tiles) each reader derives from m_block and kv_len: the Q
// loader has no registers to spare at 24 per thread.
struct SlotItem {
  int m_block;  // < 0: no more work
  int bh_q;     // b · Hq + hq
  int kv_slice;
  int kv_len;  // its batch entry's key-padding length (seqlen_kv without one)
};
// And, in the varlen kernel, its place in its sequence (varlen.cuh), derived once by the
// Q loader: the packed row of its first row, its rows inside the sequence (len_q -
// 128·m_block; more than 128 where the sequence goes on), the sequence's first K/V row
// in the workspace and its diagonal's offset (key_range.h).
struct SlotSeq {
  int q_row, rows, kv_row0, offset;
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

// The consumers' view of the storage (same bytes as the producers'). At d = 64 it is
// reached through an integer (generic) address: ptxas then schedules the consumer loop
// differently (the P·V wait after more of the softmax) and the kernel ran 11-13% faster
// at N = 8K-32K than with shared-space accesses; at d = 128 shared-space accesses were
// 1-4% faster (measured: bench/NOTES.md). A measured code-generation choice.
template <int D>
__device__ __forceinline__ SharedStorage<D>& consumer_storage(uint8_t* smem_raw,
                                                              SharedStorage<D>& shared_view) {
  if constexpr (D == 64)
    return *reinterpret_cast<SharedStorage<D>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                ~uintptr_t{1023});
  else
    return shared_view;
}

}  // namespace qattn::sage2
