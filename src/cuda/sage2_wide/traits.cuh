// The head-dim-256 SA2-8b forward (sage2_wide_sm90): its launch parameters, CTA shape,
// tile sizes and shared memory (docs/sage2-wide-kernel.md).
//
// At d = 256 a consumer warpgroup's 64 rows of FP32 O take 128 registers per thread, so
// the kernel accumulates in one level (each 64-key tile's P·V straight into O, O rescaled
// before it) and Q arrives quantized from a pass (no room for the 16-bit Q staging of the
// d <= 128 kernel's in-kernel quantizer): bench/NOTES.md v38, v39.
#pragma once

#include <cstdint>

#include "cuda/common/work_order.h"
#include "cuda/hopper/swizzle.h"
#include "numerics/key_range.h"
#include "numerics/mma_groups.h"

namespace qattn::sage2_wide {

inline constexpr int kD = 256;  // the padded head dim (inputs of 129..256 channels)

// The channels a kernel variant multiplies out of the padded 256: Q·Kᵀ over QK, P·V and
// O over V. Channels past the head dim are zeros in Q, K and V (the passes write them),
// so a variant that stops at its widths sums exactly what the full one sums. Full: every
// head dim of 129..256. Mla: Q·K of at most 192 channels with V of at most 128
// (DeepSeek-style 192/128), 640 of the full variant's 1,024 operations a pair.
template <int QK, int V>
struct Widths {
  static_assert((QK == 256 || QK == 192) && (V == 256 || V == 128));
  static constexpr int kQK = QK, kV = V;
};
using FullWidths = Widths<256, 256>;
using MlaWidths = Widths<192, 128>;

struct WideParams {
  const float* q_scale;  // (B, Hq, nq_pad / 64 * 32): the Q pass's scales, log2 folded in
  const float* q_dot_c;  // (B, Hq, nq_pad): sm_scale · q·c
  const float* k_scale;  // (B, Hkv, nkv_pad / 128 * 4)
  const float* v_amax;   // (B, Hkv, 256): V scale = amax / 448
  void* o;  // written by TMA up to column o_tma_cols, directly from there to head_dim_v
  int64_t o_stride_b, o_stride_h, o_stride_n;
  int o_tma_cols;
  float* lse;  // (B, Hq, Nq) or null
  int heads_q, heads_kv, seqlen_q, seqlen_kv;
  int head_dim_v;  // O's columns: V's head dim (Q·K's may be larger)
  int nq_pad, nkv_pad;
  int causal;              // the item order's (work_order.h)
  numerics::KeyRule keys;  // which keys each row sees; kv_len per item from kv_lengths
  const int* kv_lengths;   // (B) or null
  int num_m_blocks;        // nq_pad / 128
  int batch;
  int causal_group, causal_tail;  // the causal item order (work_order.h)
  int* item_counter;              // [0] items claimed past gridDim.x, [1] CTAs done
};

// 384 threads: warpgroup 0 holds the loader (one thread), warpgroups 1 and 2 are the
// consumers (64 query rows each). Registers move to the consumers with setmaxnreg.
inline constexpr int kThreads = 384;
inline constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
inline constexpr int kConsumerRegs = 232;
inline constexpr int kProducerRegs = (kLaunchRegs * kThreads - kConsumerRegs * 256) / 128;
static_assert(kProducerRegs == 40);

inline constexpr int kBlockM = common::kItemRows;  // 128 query rows per work item
inline constexpr int kBlockN = 64;                 // keys per tile (one softmax step)
// The rings: K (with its scales) two tiles deep, Vᵀ three, both indexed by the tile's
// ordinal on the CTA. V gets the third stage: its load is issued a turn later than K's
// (its stage frees at the end of a P·V, K's after a softmax).
inline constexpr int kKStages = 2;
inline constexpr int kVStages = 3;
inline constexpr int kQSlots = 2;
inline constexpr int kConsumerThreads = 256, kConsumerWarps = 8;
// INT8 Q and K rows of 256 bytes are loaded as two 128-byte column halves, each with the
// 128-byte swizzle (a swizzled box row is at most 128 bytes).
inline constexpr int kHalfBytes = 128;
inline constexpr int kQHalfBytes = kBlockM * kHalfBytes;  // 16 KB
inline constexpr int kKHalfBytes = kBlockN * kHalfBytes;  // 8 KB
// A V stage: the 256 rows of Vᵀ (64 tokens = 64 bytes each, 64-byte swizzle). No rows of
// ones: the row sums are FP32 sums of 448·P (kernel.cuh), not a product's columns.
inline constexpr int kVRowBytes = kBlockN;
inline constexpr int kVStageBytes = kD * kVRowBytes;
// Stages 1024-byte aligned (the swizzle pattern is taken from the address bits).
inline constexpr int kVStageStride = (kVStageBytes + 1023) / 1024 * 1024;
inline constexpr hopper::Swizzle kQKSwizzle = hopper::Swizzle::k128B;
inline constexpr hopper::Swizzle kVSwizzle = hopper::Swizzle::k64B;
static_assert(hopper::swizzle_bytes(kQKSwizzle) == kHalfBytes &&
              hopper::swizzle_bytes(kVSwizzle) == kVRowBytes);
// O staging: per consumer warpgroup 64 rows x 256 channels of 16-bit output, as four
// boxes of 64 channels (the TMA store's 128-byte swizzle).
inline constexpr int kOBoxBytes = 64 * 128;
inline constexpr int kOStageBytes = 4 * kOBoxBytes;
// K scale groups per 64-key tile: those of its 128-key tile (the groups are token % 8,
// the same in both halves).
inline constexpr int kKScales = groups::kKThreadGroupsPerTile;

// An item's side data, bulk-copied with its INT8 Q tile into its slot.
struct ItemSide {
  float q_scale[2 * groups::kQThreadGroupsPerBlock];  // the 128 rows' scale groups
  float q_dot_c[kBlockM];                             // for the LSE
  float v_amax[kD];                                   // the KV head's per-channel V amax
};

struct SharedStorage {
  alignas(1024) uint8_t q[kQSlots][2 * kQHalfBytes];  // INT8 Q: two column halves
  alignas(1024) uint8_t k[kKStages][2 * kKHalfBytes];  // INT8 K: two column halves
  alignas(1024) uint8_t v[kVStages][kVStageStride];     // E4M3 Vᵀ and the ones rows
  alignas(1024) uint8_t o[2][kOStageBytes];           // per consumer warpgroup
  alignas(16) ItemSide side[kQSlots];
  alignas(16) float k_scale[kKStages][kKScales];
};
inline constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 shared memory per block");

}  // namespace qattn::sage2_wide
