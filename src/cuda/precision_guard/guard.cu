// The precision guard's pass over Q (numerics/precision_guard.h has the rule,
// src/emulate/precision.cpp its CPU contract, python/qattn/tools/guard.py the same in
// torch). The K maxima are gathered by the SA2-8b K quantizer while it writes the codes
// (sage2_fwd/quantize.cu), so only Q is read again here.
//
// Per 64-row Q block, the SA2-8b kernel's per-thread groups (rows r and r + 8 of each
// 16-row warp slice, all channels): amax, the INT8 codes (round to nearest even of
// x·(127 / amax), as the kernel's quantizer), a = amax / 127 · scale_log2; max a² and
// max a²·|q̂_r|² over the head's rows, merged with atomicMax (maxima.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/quant_math.cuh"
#include "cuda/precision_guard/launch.h"
#include "cuda/precision_guard/maxima.cuh"
#include "numerics/mma_groups.h"
#include "numerics/sm_scale.h"

namespace qattn::guard {
namespace {

constexpr int kThreads = 128;      // four warps, one 16-row slice each
constexpr int kGroupsPerWarp = 8;  // row pairs (g, g + 8) of a slice
constexpr int kChunkElems = 8;     // 16 bytes of 16-bit values
constexpr int kLanesPerRow = 16;   // head dims up to 128: 16 chunks per row

struct QArgs {
  const void* q;
  int64_t stride_b, stride_h, stride_n;
  int heads_q, seqlen_q, head_dim;
  float scale_log2;
  float* out;  // (B, Hq, 2)
};

// The 8 values of a lane's chunk (zeros past the row's end or past Nq). kVector: one
// 16-byte load (head_dim, the strides and the base are multiples of 8 elements).
template <typename T, bool kVector>
__device__ __forceinline__ void load_chunk(const T* row, bool valid, int c0, int head_dim,
                                           float (&x)[kChunkElems]) {
  if constexpr (kVector) {
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (valid && c0 < head_dim) raw = *reinterpret_cast<const uint4*>(row + c0);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) x[j] = common::to_float(v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j)
      x[j] = valid && c0 + j < head_dim ? common::to_float(row[c0 + j]) : 0.f;
  }
}

// grid (Nq_pad / 64, Hq, B), 128 threads: warp w takes rows 16w..16w+15 of the block;
// lane l holds chunk l % 16 of row g + 8·(l / 16) of each group g. All eight groups'
// loads are issued before any arithmetic, so a warp keeps 4 KB in flight.
template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) q_maxima_kernel(const QArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hq = blockIdx.y, b = blockIdx.z;
  const T* head = static_cast<const T*>(a.q) + b * a.stride_b + hq * a.stride_h;
  const int c0 = (lane % kLanesPerRow) * kChunkElems;
  const int slice_row = blockIdx.x * groups::kQBlock + 16 * warp + 8 * (lane / kLanesPerRow);
  float x[kGroupsPerWarp][kChunkElems];
#pragma unroll
  for (int g = 0; g < kGroupsPerWarp; ++g) {
    const int row = slice_row + g;
    load_chunk<T, kVector>(head + static_cast<int64_t>(row) * a.stride_n, row < a.seqlen_q, c0,
                           a.head_dim, x[g]);
  }
  float step2_max = 0.f, norm2_max = 0.f;
#pragma unroll
  for (int g = 0; g < kGroupsPerWarp; ++g) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) amax = nan_max(amax, fabsf(x[g][j]));
    amax = warp_nan_max(amax);  // the group: both rows, all channels
    // The kernel's codes: x · (127 / amax) rounded to nearest even (|·| <= 127 already).
    const float inv = amax > 0.f ? common::kInt8Max / amax : 0.f;
    int n2 = 0;
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) {
      const int code = max(-127, min(127, __float2int_rn(__fmul_rn(x[g][j], inv))));
      n2 += code * code;
    }
#pragma unroll
    for (int o = 1; o < kLanesPerRow; o *= 2) n2 += __shfl_xor_sync(0xffffffff, n2, o);  // the row
    const float step = amax / common::kInt8Max * a.scale_log2;  // a_i, as the emulator's
    const float step2 = step * step;
    step2_max = nan_max(step2_max, step2);
    norm2_max = nan_max(norm2_max, step2 * static_cast<float>(n2));
  }
  norm2_max = nan_max(norm2_max, __shfl_xor_sync(0xffffffff, norm2_max, kLanesPerRow));
  if (lane == 0) {
    float* out = a.out + 2 * (static_cast<int64_t>(b) * a.heads_q + hq);
    atomic_max_bits(out, step2_max);
    atomic_max_bits(out + 1, norm2_max);
  }
}

template <typename T>
void launch_q(const QArgs& qa, dim3 grid, bool vector, cudaStream_t stream) {
  if (vector)
    q_maxima_kernel<T, true><<<grid, kThreads, 0, stream>>>(qa);
  else
    q_maxima_kernel<T, false><<<grid, kThreads, 0, stream>>>(qa);
}

}  // namespace

cudaError_t launch_q_maxima(const qattn_fwd_params& p, float* q_maxima, cudaStream_t stream) {
  const std::size_t bytes = std::size_t(p.batch) * p.heads_q * 2 * sizeof(float);
  if (auto e = cudaMemsetAsync(q_maxima, 0, bytes, stream); e != cudaSuccess)
    return e;
  constexpr float kLog2e = 1.4426950408889634f;
  const float sm_scale = p.sm_scale > 0.f ? p.sm_scale : numerics::default_sm_scale(p.head_dim);
  const QArgs qa{p.q.data,   p.q.stride_b, p.q.stride_h, p.q.stride_n, p.heads_q,
                 p.seqlen_q, p.head_dim,   sm_scale * kLog2e, q_maxima};
  const int q_blocks = (p.seqlen_q + groups::kQBlock - 1) / groups::kQBlock;
  const dim3 grid(static_cast<unsigned>(q_blocks), static_cast<unsigned>(p.heads_q),
                  static_cast<unsigned>(p.batch));
  // 16-byte loads where every row's chunks are 16-byte aligned.
  const bool vector = p.head_dim % kChunkElems == 0 &&
                      reinterpret_cast<uintptr_t>(p.q.data) % 16 == 0 &&
                      p.q.stride_b % kChunkElems == 0 && p.q.stride_h % kChunkElems == 0 &&
                      p.q.stride_n % kChunkElems == 0;
  if (p.dtype == QATTN_DTYPE_BF16)
    launch_q<__nv_bfloat16>(qa, grid, vector, stream);
  else
    launch_q<__half>(qa, grid, vector, stream);
  return cudaGetLastError();
}

}  // namespace qattn::guard
