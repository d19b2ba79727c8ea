// The head-dim-256 forward's epilogue: a consumer warpgroup's 64 rows of O (times the V
// scale, divided by the row sum l of the thread's rows g and g + 8) staged in shared memory for
// the TMA store, and the natural-log LSE.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/e4m3.cuh"
#include "cuda/common/fragment.cuh"
#include "cuda/sage2_fwd/epilogue.cuh"
#include "cuda/sage2_wide/traits.cuh"

namespace qattn::sage2_wide {

// O's accumulator for V channels 0..kV-1: channels 0..127 in lo and, at kV = 256,
// 128..255 in hi, one m64n128 product each (the row sums are FP32 sums of P, kernel.cuh).
// At kV = 128 hi is a placeholder register that nothing reads.
template <int kV>
struct OAcc {
  static constexpr int kLo = 64, kHi = kV > 128 ? 64 : 0;
  static constexpr int kHiRegs = kHi > 0 ? kHi : 1;
};

// Element i of the thread's O values (channel 8(i / 4) + 2t + i % 2).
template <int kV>
__device__ __forceinline__ float o_at(const float (&lo)[OAcc<kV>::kLo],
                                      const float (&hi)[OAcc<kV>::kHiRegs], int i) {
  return i < OAcc<kV>::kLo ? lo[i] : hi[i - OAcc<kV>::kLo];
}

// Writes the thread's two rows into the warpgroup's staging (kV / 64 boxes of 64
// channels, 128-byte rows, 16-byte chunks swizzled by row % 8). row_in_wg = warp · 16 + g.
template <typename TOut, int kV>
__device__ __forceinline__ void stage_output(const float (&lo)[OAcc<kV>::kLo],
                                             const float (&hi)[OAcc<kV>::kHiRegs], const float (&l)[2],
                                             common::FragCoord fc, int row_in_wg,
                                             const float* v_amax, uint8_t* stage) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // A row that sees no key has l = 0: O = 0.
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const int row = row_in_wg + 8 * r;
#pragma unroll
    for (int j = 0; j < kV / 8; ++j) {
      const float2 a = *reinterpret_cast<const float2*>(v_amax + 8 * j + 2 * fc.t);
      // The V scale as the d <= 128 kernel's quantizer computes it: amax / 448.
      const float v0 = o_at<kV>(lo, hi, 4 * j + 2 * r) * (a.x / common::kE4M3Max) * inv;
      const float v1 = o_at<kV>(lo, hi, 4 * j + 2 * r + 1) * (a.y / common::kE4M3Max) * inv;
      const int chunk = (j % 8) ^ (row % 8);
      *reinterpret_cast<uint32_t*>(stage + (j / 8) * kOBoxBytes + row * 128 + chunk * 16 +
                                   4 * fc.t) = sage2::pack2<TOut>(v0, v1);
    }
  }
}

// The natural-log LSE of the thread's rows (lanes with t = 0), corrected for the K
// smoothing by q·c; -inf for a row that saw no key.
__device__ __forceinline__ void store_lse(const WideParams& p, const float (&m)[2],
                                          const float (&l)[2], common::FragCoord fc,
                                          int64_t bh_q, int block_row0, int row_in_block,
                                          const float* q_dot_c) {
  if (p.lse == nullptr || fc.t != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = block_row0 + row_in_block + 8 * r;
    if (row >= p.seqlen_q) continue;
    p.lse[bh_q * p.seqlen_q + row] =
        l[r] > 0.f ? (m[r] + log2f(l[r]) - common::kLog2E4M3Max) * sage2::kLn2 +
                      q_dot_c[row_in_block + 8 * r]
                : -INFINITY;
  }
}

// The columns from o_tma_cols to head_dim (head_dim % 8 != 0), which the TMA boxes
// leave out: thread tid_wg < 64 copies row tid_wg of the staged rows.
__device__ __forceinline__ void store_output_tail(const WideParams& p, int bh_q, int wg_row0,
                                                  const uint8_t* stage) {
  const int tid_wg = sage2::warpgroup_thread_opaque();
  const int row = wg_row0 + tid_wg;
  if (tid_wg >= 64 || row >= p.seqlen_q) return;
  const int j = p.o_tma_cols / 8;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(
      stage + (j / 8) * kOBoxBytes + tid_wg * 128 + ((j % 8) ^ (tid_wg % 8)) * 16);
  const int b = bh_q / p.heads_q, hq = bh_q % p.heads_q;
  uint16_t* dst = static_cast<uint16_t*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h +
                  static_cast<int64_t>(row) * p.o_stride_n + p.o_tma_cols;
  for (int c = 0; c < p.head_dim_v - p.o_tma_cols; ++c) dst[c] = src[c];
}

}  // namespace qattn::sage2_wide
