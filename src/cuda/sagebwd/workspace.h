// Workspace layout of the SageBwd backward (launch.h). Plain C++: the family's
// declaration sizes it in every build, and the GPU tests read it back.
//
// Every buffer is per (batch, head) slice, contiguous, zero-padded: Q-side rows to
// Nq_pad (a multiple of the 64-row Q block), K-side rows to Nkv_pad (a multiple of the
// 128-token KV tile), columns to D (the head dim padded to 64 or 128). The "int8"
// buffers (*_i8) hold the format's 8-bit codes: INT8 (scales amax/127), or E4M3 (scales
// amax/448) with QATTN_BWD_E4M3 (format8.cuh).
//   q_i8      int8  (B, Hq, Nq_pad, D)    Q, per Q block
//   qt_i8     int8  (B, Hq, D, Nq_pad)    Qᵀ, rows permuted in groups of 16 (the
//                                         register layout of P̂ᵀ/dŜᵀ, permute.cuh)
//   do_16     16-bit (B, Hq, Nq_pad, D)   dO in the inputs' format
//   do_i8     int8  (B, Hq, Nq_pad, D)    dO per Q block (quantized dO·Vᵀ only)
//   dot_i8    int8  (B, Hq, D, Nq_pad)    dOᵀ per Q block, permuted as qt_i8
//   q_scale, do_scale  float (B, Hq, Nq_pad / 64)
//   lse2      float (B, Hq, Nq_pad)       (LSE − sm_scale·q·c)·log2 e: the saved LSE in
//                                         the smoothed log2 domain of the scores; +inf on
//                                         padding rows (their P is 0)
//   delta     float (B, Hq, Nq_pad)       D = rowsum(dO ∘ O)
//   dq_acc    float (B, Hq, Nq_pad, D)    dQ accumulator (FP32 reductions, or the
//                                         deterministic dQ kernel's plain stores)
//   k_i8      int8  (B, Hkv, Nkv_pad, D)  smoothed K, per KV tile
//   kt_i8     int8  (B, Hkv, D, Nkv_pad)  its transpose (dQ = dS·K reduces over tokens),
//                                         tokens in σ order (permute.cuh)
//   v_16      16-bit (B, Hkv, Nkv_pad, D) V in the inputs' format
//   v_i8      int8  (B, Hkv, Nkv_pad, D)  V per KV tile (quantized dO·Vᵀ only)
//   k_scale, v_scale  float (B, Hkv, Nkv_pad / 128)
//   k_mean    float (B, Hkv, D)           the smoothing vector c: the mean of the
//                                         forward's token sample (numerics/token_sample.h)
// With the merge-free scales (QATTN_BWD_SCALES_MERGE_FREE; 0 bytes otherwise; qt_i8 and
// dot_i8 then hold E4M3(s_i·Q / s_Q') and E4M3(dO / s_dO) per channel, q_scale's and
// do_scale's dO part unused):
//   s_row, inv_s  float (B, Hq, Nq_pad)   s_i = p_max_i·(Σ_c |dO_ic|·max|V_c| + |D_i|)/448
//                                         and 1/s_i (0 for padding and keyless rows)
//   v_max, do_max, sq_max  float (B, Hkv, D)  channel maxima of |V| (FP16), |dO| and
//                                         |s_i·Q| over the KV head's group
#pragma once

#include <cstddef>
#include <cstdint>

#include "numerics/mma_groups.h"
#include "qattn/qattn.h"

namespace qattn::sagebwd {

inline constexpr std::size_t kWorkspaceAlign = 256;
inline constexpr int kQBlock = groups::kQBlock;  // 64
inline constexpr int kKvTile = groups::kKvTile;  // 128

struct WorkspaceLayout {
  int head_dim_padded = 0;  // 64 or 128
  int nq_pad = 0, nkv_pad = 0;
  std::size_t q_i8 = 0, qt_i8 = 0, do_16 = 0, do_i8 = 0, dot_i8 = 0, q_scale = 0, do_scale = 0,
              lse2 = 0, delta = 0, dq_acc = 0, k_i8 = 0, kt_i8 = 0, v_16 = 0,
              v_i8 = 0, k_scale = 0, v_scale = 0, k_mean = 0, s_row = 0, inv_s = 0, v_max = 0,
              do_max = 0, sq_max = 0, total = 0;
};

inline int padded_head_dim(int d) { return d <= 64 ? 64 : 128; }

inline WorkspaceLayout workspace_layout(const qattn_bwd_params& p) {
  auto round_up = [](std::size_t x, std::size_t m) { return (x + m - 1) / m * m; };
  WorkspaceLayout w;
  w.head_dim_padded = padded_head_dim(p.head_dim);
  w.nq_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.seqlen_q), kQBlock));
  w.nkv_pad = static_cast<int>(round_up(static_cast<std::size_t>(p.seqlen_kv), kKvTile));
  const std::size_t D = static_cast<std::size_t>(w.head_dim_padded);
  const std::size_t rq = static_cast<std::size_t>(p.batch) * p.heads_q * w.nq_pad;
  const std::size_t rk = static_cast<std::size_t>(p.batch) * p.heads_kv * w.nkv_pad;
  const bool quant_dov = p.dov == QATTN_BWD_DOV_QUANTIZED;
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off = round_up(off + bytes, kWorkspaceAlign);
    return at;
  };
  w.q_i8 = take(rq * D);
  w.qt_i8 = take(rq * D);
  w.do_16 = take(rq * D * 2);
  w.do_i8 = take(quant_dov ? rq * D : 0);
  w.dot_i8 = take(rq * D);
  w.q_scale = take(rq / kQBlock * sizeof(float));
  w.do_scale = take(rq / kQBlock * sizeof(float));
  w.lse2 = take(rq * sizeof(float));
  w.delta = take(rq * sizeof(float));
  w.dq_acc = take(rq * D * sizeof(float));
  w.k_i8 = take(rk * D);
  w.kt_i8 = take(rk * D);
  w.v_16 = take(rk * D * 2);
  w.v_i8 = take(quant_dov ? rk * D : 0);
  w.k_scale = take(rk / kKvTile * sizeof(float));
  w.v_scale = take(rk / kKvTile * sizeof(float));
  w.k_mean = take(static_cast<std::size_t>(p.batch) * p.heads_kv * D * sizeof(float));
  const bool merge_free = p.scales == QATTN_BWD_SCALES_MERGE_FREE;
  const std::size_t channels = static_cast<std::size_t>(p.batch) * p.heads_kv * D * sizeof(float);
  w.s_row = take(merge_free ? rq * sizeof(float) : 0);
  w.inv_s = take(merge_free ? rq * sizeof(float) : 0);
  w.v_max = take(merge_free ? channels : 0);
  w.do_max = take(merge_free ? channels : 0);
  w.sq_max = take(merge_free ? channels : 0);
  w.total = off;
  return w;
}

}  // namespace qattn::sagebwd
