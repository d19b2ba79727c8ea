// Writes O (divided by the row sum) and the natural-log LSE of a thread's two rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/sage2_fwd/fragment.cuh"
#include "cuda/sage2_fwd/softmax.cuh"

namespace qattn::sage2 {

inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kE4m3MaxF = 448.f;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename TOut, int kO, typename Params, typename Softmax>
__device__ __forceinline__ void store_output(const Params& p, const float (&o)[kO],
                                             const Softmax& sm, FragCoord fc, int64_t bh_q,
                                             int block_row0, int row_in_block,
                                             const float* v_amax, const float* q_dot_c) {
  // v_amax (the KV head's D channels) and q_dot_c (the block's rows) are in shared memory.
  const int b = static_cast<int>(bh_q / p.heads_q), h = static_cast<int>(bh_q % p.heads_q);
  // Per-channel V scale (amax / 448) of the thread's columns 8j + 2t, 8j + 2t + 1.
  float v_scale[kO / 2];
#pragma unroll
  for (int j = 0; j < kO / 4; ++j) {
    const float2 a = *reinterpret_cast<const float2*>(v_amax + 8 * j + 2 * fc.t);
    v_scale[2 * j] = a.x / kE4m3MaxF;
    v_scale[2 * j + 1] = a.y / kE4m3MaxF;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = block_row0 + row_in_block + 8 * r;
    if (row >= p.seqlen_q) continue;
    const float l = sm.l[r];
    // A row with no visible key (causal, Nq > Nkv) has l = 0: O = 0, LSE = -inf.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    TOut* dst = static_cast<TOut*>(p.o) + b * p.o_stride_b + h * p.o_stride_h + row * p.o_stride_n;
#pragma unroll
    for (int j = 0; j < kO / 4; ++j) {
      const int col = 8 * j + 2 * fc.t;
      const float v0 = o[4 * j + 2 * r] * v_scale[2 * j] * inv;
      const float v1 = o[4 * j + 2 * r + 1] * v_scale[2 * j + 1] * inv;
      if (col + 1 < p.head_dim) {
        *reinterpret_cast<uint32_t*>(dst + col) = pack2<TOut>(v0, v1);
      } else if (col < p.head_dim) {
        dst[col] = static_cast<TOut>(v0);
      }
    }
    if (p.lse != nullptr && fc.t == 0) {
      p.lse[bh_q * p.seqlen_q + row] =
          l > 0.f ? (sm.m[r] + log2f(l) - kLog2E4m3Max) * kLn2 + q_dot_c[row_in_block + 8 * r]
                  : -INFINITY;
    }
  }
}

}  // namespace qattn::sage2
