// Workspace layout of the SageAttention2-8b forward (see launch.h). Plain C++ so the
// CPU emulator's tests can read a kernel's workspace back and compare it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common/work_order.h"
#include "numerics/mma_groups.h"
#include "qattn/qattn.h"

namespace qattn::sage2 {

inline constexpr std::size_t kWorkspaceAlign = 256;
inline constexpr int kQTile = common::kItemRows;  // query rows per work item (a CTA's block)
inline constexpr std::size_t kSeqPlaceBytes = 32;  // sizeof(SeqPlace) (varlen.cuh)

struct WorkspaceLayout {
  int head_dim_padded = 0;  // 64 or 128 (256 in the head-dim-256 forward)
  int nq_pad = 0, nkv_pad = 0;
  std::size_t q_i8 = 0, q_scale = 0, q_dot_c = 0, k_i8 = 0, k_scale = 0, k_mean = 0, vt_f8 = 0,
              v_amax = 0, v_over = 0, item_counter = 0, mask_tiles = 0, mask_bits = 0, mask_classes = 0,
              varlen_seqs = 0, varlen_entries = 0, varlen_count = 0, total = 0;
  // A packed batch (cu_seqlens, varlen.cuh): K and V of every sequence in 128-aligned
  // rows of kv_slices = Hkv slices of nkv_pad rows (dense: B·Hkv slices of Nkv_pad), nq_pad
  // the longest sequence's padded length, and room for max_entries query blocks.
  bool varlen = false;
  int kv_slices = 0;
  int max_entries = 0;
  // attn_mask: its slices (1, B or Hq or B·Hq: the dimensions it does not broadcast).
  int mask_slices = 0;
  // Element counts per (batch, head) slice.
  std::size_t q_scales_per_head() const {
    return static_cast<std::size_t>(nq_pad) / groups::kQBlock * groups::kQThreadGroupsPerBlock;
  }
  std::size_t k_scales_per_head() const {
    return static_cast<std::size_t>(nkv_pad) / groups::kKvTile * groups::kKThreadGroupsPerTile;
  }
  std::size_t kv_tiles() const { return static_cast<std::size_t>(nkv_pad) / groups::kKvTile; }
};

inline int padded_head_dim(int d) { return d <= 64 ? 64 : 128; }

// Whether an attn_mask has a slice per batch entry / per query head (a stride of 0, or
// a dimension of one, broadcasts).
inline bool mask_per_batch(const qattn_fwd_params& p) {
  return p.batch > 1 && p.attn_mask_stride_b != 0;
}
inline bool mask_per_head(const qattn_fwd_params& p) {
  return p.heads_q > 1 && p.attn_mask_stride_h != 0;
}
inline int mask_slices(const qattn_fwd_params& p) {
  return (mask_per_batch(p) ? p.batch : 1) * (mask_per_head(p) ? p.heads_q : 1);
}

// keep_q: also room for the quantized Q, its scales and q·c, which the attention kernel
// otherwise keeps in shared memory only (the GPU tests read them back; the head-dim-256
// forward, cuda/sage2_wide/, quantizes Q by a pass into them). head_dim_padded: D, 0 for
// this family's 64 or 128 (the head-dim-256 forward passes 256).
inline WorkspaceLayout workspace_layout(const qattn_fwd_params& p, bool keep_q = false,
                                        int head_dim_padded = 0) {
  auto round_up = [](std::size_t x, std::size_t m) { return (x + m - 1) / m * m; };
  WorkspaceLayout w;
  w.head_dim_padded = head_dim_padded > 0 ? head_dim_padded : padded_head_dim(p.head_dim);
  w.nq_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.seqlen_q), kQTile));
  w.nkv_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.seqlen_kv), groups::kKvTile));
  const std::size_t D = static_cast<std::size_t>(w.head_dim_padded);
  const std::size_t bq = static_cast<std::size_t>(p.batch) * p.heads_q;
  const std::size_t bkv = static_cast<std::size_t>(p.batch) * p.heads_kv;
  w.varlen = p.cu_seqlens_q != nullptr;
  w.kv_slices = static_cast<int>(w.varlen ? p.heads_kv : bkv);
  if (w.varlen) {
    // Each sequence's keys start a tile and take at least one: at most 128 rows more
    // than its keys. Query blocks: sum of ceil(len_q / 128) <= (total_q + 127·B) / 128.
    const std::size_t batch = static_cast<std::size_t>(p.batch);
    w.nq_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.max_seqlen_q), kQTile));
    w.nkv_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.seqlen_kv) +
                                              groups::kKvTile * batch, groups::kKvTile));
    w.max_entries = static_cast<int>((static_cast<std::size_t>(p.seqlen_q) + (kQTile - 1) * batch) /
                                     kQTile);
  }
  const std::size_t kv_rows = static_cast<std::size_t>(w.kv_slices) * w.nkv_pad;
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off = round_up(off + bytes, kWorkspaceAlign);
    return at;
  };
  const std::size_t q_rows = keep_q ? bq * w.nq_pad : 0;
  w.q_i8 = take(q_rows * D);
  w.q_scale = take(keep_q ? bq * w.q_scales_per_head() * sizeof(float) : 0);
  w.q_dot_c = take(q_rows * sizeof(float));
  w.k_i8 = take(kv_rows * D);
  w.k_scale = take(w.kv_slices * w.k_scales_per_head() * sizeof(float));
  w.k_mean = take(bkv * D * sizeof(float));
  w.vt_f8 = take(kv_rows * D);
  w.v_amax = take(bkv * D * sizeof(float));
  // Per V channel: 0 where the sampled amax bound covers every value, else the exact amax
  // (its bits; the fix-up kernel's work). With the attention kernel's two work counters,
  // the statistics kernel zeroes it at the start of each forward: no memset is needed.
  w.v_over = take(bkv * D * sizeof(std::uint32_t));
  w.item_counter = take(2 * sizeof(int));
  // attn_mask (attn_mask.cuh): per slice and query block a tile list (a count, then up to
  // one entry per KV tile), per slice a bit per (row, key), and the classes its pass
  // writes first (a byte per tile).
  if (p.attn_mask_type != QATTN_MASK_NONE) {
    w.mask_slices = mask_slices(p);
    const std::size_t blocks = static_cast<std::size_t>(w.mask_slices) * (w.nq_pad / kQTile);
    w.mask_tiles = take(blocks * (w.kv_tiles() + 1) * sizeof(int));
    // (An additive mask's cut tiles read the caller's values: no bits.)
    if (p.attn_mask_type == QATTN_MASK_BOOL) w.mask_bits = take(blocks * kQTile * (w.nkv_pad / 8));
    w.mask_classes = take(blocks * w.kv_tiles());
  }
  if (w.varlen) {
    w.varlen_seqs = take(static_cast<std::size_t>(p.batch) * kSeqPlaceBytes);
    w.varlen_entries = take(static_cast<std::size_t>(w.max_entries) * 2 * sizeof(int));
    w.varlen_count = take(sizeof(int));
  }
  w.total = off;
  return w;
}

}  // namespace qattn::sage2
