// The epilogue of a work item: O (divided by the row sum) through shared memory and TMA,
// and the natural-log LSE of a thread's two rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/fragment.cuh"
#include "cuda/common/pack16.cuh"
#include "cuda/common/work_order.h"
#include "cuda/sage2_fwd/softmax.cuh"

namespace qattn::sage2 {

inline constexpr float kLn2 = 0.6931471805599453f;

using common::pack2;

// The output of one consumer warpgroup (64 rows) is staged in shared memory, then written
// by TMA stores of 64-channel × 64-row boxes: coalesced, asynchronous, and clipped to the
// tensor (rows past Nq, channels past head_dim are never written). With STG from the
// accumulator layout (4 bytes per thread, half-used sectors) the epilogue cost 8-25% of
// the kernel (measured: bench/NOTES.md).
inline constexpr int kOBoxBytes = 64 * 128;  // 64 rows × 64 channels × 2 bytes

// Writes this thread's rows of O (o times the V scale, divided by the row sum) into the
// warpgroup's staging area: box j / 8 holds channels 64·(j / 8) ..., each 128-byte row
// with its 16-byte chunks swizzled by row % 8 (the TMA 128B swizzle; conflict-free here).
// row_in_wg = warp · 16 + g.
template <typename TOut, int kO, typename Softmax>
__device__ __forceinline__ void stage_output(const float (&o)[kO], const Softmax& sm, common::FragCoord fc,
                                             int row_in_wg, const float* v_scale_head,
                                             uint8_t* stage) {
  // Per-channel V scale (amax / 448) of the thread's columns 8j + 2t, 8j + 2t + 1, from
  // the KV head's D channels in shared memory.
  float v_scale[kO / 2];
#pragma unroll
  for (int j = 0; j < kO / 4; ++j) {
    const float2 a = *reinterpret_cast<const float2*>(v_scale_head + 8 * j + 2 * fc.t);
    v_scale[2 * j] = a.x;
    v_scale[2 * j + 1] = a.y;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = sm.l[r];
    // A row that sees no key (all its scores masked) has l = 0: O = 0.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row_in_wg + 8 * r;
#pragma unroll
    for (int j = 0; j < kO / 4; ++j) {
      const float v0 = o[4 * j + 2 * r] * v_scale[2 * j] * inv;
      const float v1 = o[4 * j + 2 * r + 1] * v_scale[2 * j + 1] * inv;
      const int chunk = (j % 8) ^ (row % 8);
      *reinterpret_cast<uint32_t*>(stage + (j / 8) * kOBoxBytes + row * 128 + chunk * 16 +
                                   4 * fc.t) = pack2<TOut>(v0, v1);
    }
  }
}

// The columns from o_tma_cols to head_dim (the partial 16-byte chunk at the end of a row,
// head_dim % 8 != 0), which the TMA boxes leave out: copied from the staging area to
// dst_row() (the row's column o_tma_cols in global memory) after the warpgroup's barrier
// by thread tid_wg < 64 of the warpgroup, which owns row tid_wg of the staged box.
// (dst_row is called after the source address is formed: that order keeps the machine
// code of the kernels as it was before the helper existed.)
template <typename Params, typename DstRow>
__device__ __forceinline__ void copy_tail_columns(const Params& p, int tid_wg, const uint8_t* stage,
                                                  DstRow dst_row) {
  const int j = p.o_tma_cols / 8;  // the partial chunk
  const uint16_t* src = reinterpret_cast<const uint16_t*>(
      stage + (j / 8) * kOBoxBytes + tid_wg * 128 + ((j % 8) ^ (tid_wg % 8)) * 16);
  uint16_t* dst = dst_row();
  for (int c = 0; c < p.head_dim_v - p.o_tma_cols; ++c) dst[c] = src[c];
}

// The thread's index in its warpgroup, read opaquely: the row's staging offset derived
// from it, hoisted out of the consumers' loop as loop-invariant, was spilled at 232
// registers.
__device__ __forceinline__ int warpgroup_thread_opaque() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid % 128;
}

// copy_tail_columns for the dense kernel: thread i < 64 of the warpgroup writes row
// wg_row0 + i of (batch, head) bh_q where it is below seqlen_q.
template <typename Params>
__device__ __forceinline__ void store_output_tail(const Params& p, int bh_q, int wg_row0,
                                                  const uint8_t* stage) {
  const int tid_wg = warpgroup_thread_opaque();
  const int row = wg_row0 + tid_wg;
  if (tid_wg >= 64 || row >= p.seqlen_q) return;
  copy_tail_columns(p, tid_wg, stage, [&] {
    const int b = bh_q / p.heads_q, hq = bh_q % p.heads_q;
    return static_cast<uint16_t*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h +
           static_cast<int64_t>(row) * p.o_stride_n + p.o_tma_cols;
  });
}

// The varlen kernel's last box of a sequence (fewer than 64 of its rows are the
// sequence's: a TMA box would write into the next sequence's rows): each thread writes
// its rows below `rows` straight from its registers (what stage_output stages), 4 bytes
// at a time, to packed rows dst_row0.. of query head hq.
template <typename TOut, int kO, typename Softmax, typename Params>
__device__ __forceinline__ void store_output_direct(const float (&o)[kO], const Softmax& sm,
                                                    common::FragCoord fc, int row_in_wg,
                                                    const float* v_scale_head, const Params& p,
                                                    int hq, int64_t dst_row0, int rows) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_in_wg + 8 * r;
    if (row >= rows) continue;
    const float l = sm.l[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    auto* dst = static_cast<uint16_t*>(p.o) + hq * p.o_stride_h + (dst_row0 + row) * p.o_stride_n;
#pragma unroll
    for (int j = 0; j < kO / 4; ++j) {
      const int col = 8 * j + 2 * fc.t;
      const float2 s = *reinterpret_cast<const float2*>(v_scale_head + col);
      const uint32_t v = pack2<TOut>(o[4 * j + 2 * r] * s.x * inv, o[4 * j + 2 * r + 1] * s.y * inv);
      if (col + 1 < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(dst + col) = v;
      else if (col < p.head_dim_v)
        dst[col] = static_cast<uint16_t>(v);
    }
  }
}

// copy_tail_columns for the varlen kernel's whole boxes: the rows start at packed row
// dst_row0 of query head hq.
template <typename Params>
__device__ __forceinline__ void store_output_tail_varlen(const Params& p, int hq, int64_t dst_row0,
                                                         const uint8_t* stage) {
  const int tid_wg = warpgroup_thread_opaque();
  if (tid_wg >= 64) return;
  copy_tail_columns(p, tid_wg, stage, [&] {
    return static_cast<uint16_t*>(p.o) + hq * p.o_stride_h + (dst_row0 + tid_wg) * p.o_stride_n +
           p.o_tma_cols;
  });
}

// The natural-log LSE of row r (0 or 1) of a thread's two, corrected for the K smoothing
// by the row's q·c (read only for a row that saw a key); -inf for a row that saw none.
template <typename Softmax>
__device__ __forceinline__ float lse_of_row(const Softmax& sm, int r, const float* q_dot_c) {
  const float l = sm.l[r];
  return l > 0.f ? (sm.m[r] + log2f(l) - common::kLog2E4M3Max) * kLn2 + *q_dot_c : -INFINITY;
}

// Writes the natural-log LSE of a thread's two rows (block rows row_in_block, + 8),
// corrected for the K smoothing by q·c (in shared memory), and where asked P's row maximum
// exp2(m − lse2) = 448 / l (l carries P's factor 448; 0 for a row that saw no key).
template <typename Params, typename Softmax>
__device__ __forceinline__ void store_lse(const Params& p, const Softmax& sm, common::FragCoord fc,
                                          int64_t bh_q, int block_row0, int row_in_block,
                                          const float* q_dot_c) {
  if ((p.lse == nullptr && p.p_max == nullptr) || fc.t != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = block_row0 + row_in_block + 8 * r;
    if (row >= p.seqlen_q) continue;
    if (p.lse != nullptr)
      p.lse[bh_q * p.seqlen_q + row] = lse_of_row(sm, r, q_dot_c + row_in_block + 8 * r);
    if (p.p_max != nullptr)
      p.p_max[bh_q * p.seqlen_q + row] = sm.l[r] > 0.f ? common::kE4M3Max / sm.l[r] : 0.f;
  }
}

// store_lse for the varlen kernel: the item's rows below `rows` (those of its sequence),
// from packed row q_row, in the (Hq, total_q) LSE of FlashAttention's varlen layout.
template <typename Params, typename Softmax>
__device__ __forceinline__ void store_lse_varlen(const Params& p, const Softmax& sm,
                                                 common::FragCoord fc, int hq, int q_row, int rows,
                                                 int row_in_block, const float* q_dot_c) {
  if (p.lse == nullptr || fc.t != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_in_block + 8 * r;
    if (row >= rows) continue;
    p.lse[static_cast<int64_t>(hq) * p.varlen.total_q + q_row + row] = lse_of_row(sm, r, q_dot_c + row);
  }
}

}  // namespace qattn::sage2
