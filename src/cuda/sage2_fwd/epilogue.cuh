// Writes O (divided by the row sum) and the natural-log LSE of a thread's two rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/sage2_fwd/fragment.cuh"
#include "cuda/sage2_fwd/softmax.cuh"

namespace qattn::sage2 {

inline constexpr float kLn2 = 0.6931471805599453f;

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
__device__ __forceinline__ void store_output(const Params& p, const float (&o)[kO], const Softmax& sm,
                                             FragCoord fc, int64_t bh_q, int row0) {
  const int b = static_cast<int>(bh_q / p.heads_q), h = static_cast<int>(bh_q % p.heads_q);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= p.seqlen_q) continue;
    const float l = sm.l[r];
    // A row with no visible key (causal, Nq > Nkv) has l = 0: O = 0, LSE = -inf.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    TOut* dst = static_cast<TOut*>(p.o) + b * p.o_stride_b + h * p.o_stride_h + row * p.o_stride_n;
#pragma unroll
    for (int j = 0; j < kO / 4; ++j) {
      const int col = 8 * j + 2 * fc.t;
      const float v0 = o[4 * j + 2 * r] * inv, v1 = o[4 * j + 2 * r + 1] * inv;
      if (col + 1 < p.head_dim) {
        *reinterpret_cast<uint32_t*>(dst + col) = pack2<TOut>(v0, v1);
      } else if (col < p.head_dim) {
        dst[col] = static_cast<TOut>(v0);
      }
    }
    if (p.lse != nullptr && fc.t == 0) {
      p.lse[bh_q * p.seqlen_q + row] =
          l > 0.f ? (sm.m[r] + log2f(l) - kLog2E4m3Max) * kLn2 + p.q_dot_c[bh_q * p.nq_pad + row]
                  : -INFINITY;
    }
  }
}

}  // namespace qattn::sage2
