// The precision guard's two gathering kernels (numerics/precision_guard.h has the rule,
// src/emulate/precision.cpp its CPU contract, python/qattn/tools/guard.py the same in
// torch). Both write per-head maxima with atomicMax on the FP32 bit patterns, which
// order like the values for values >= 0; a NaN is written as the positive quiet NaN,
// whose pattern is above +inf, so a NaN anywhere in a head wins its maximum.
//
//   q_stats: per 64-row Q block, the SA2-8b kernel's per-thread groups (rows r and r + 8
//     of each 16-row warp slice, all channels): amax, the INT8 codes (round to nearest
//     even of x·(127 / amax), as the kernel's quantizer), a = amax / 127 · scale_log2;
//     max a² and max a²·|q̂_r|² over the head's rows. One warp per slice, lanes across
//     the channels.
//   k_stats: per token of the workspace's smoothed INT8 K, b² and b²·|k̂|² (b its group's
//     step, the kernel's k_scale): one thread per token.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/quant_math.cuh"
#include "cuda/precision_guard/launch.h"
#include "numerics/mma_groups.h"

namespace qattn::guard {
namespace {

constexpr uint32_t kQuietNan = 0x7fc00000u;
constexpr int kMaxChannelsPerLane = 4;  // head dims up to 128 over 32 lanes

__device__ __forceinline__ float nan_max(float a, float b) {
  return (a != a || b != b) ? __uint_as_float(kQuietNan) : fmaxf(a, b);
}
__device__ __forceinline__ float warp_nan_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = nan_max(x, __shfl_xor_sync(0xffffffff, x, o));
  return x;
}
__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
// atomicMax of a value >= 0 (or NaN) on its bit pattern.
__device__ __forceinline__ void atomic_max_bits(float* at, float v) {
  const uint32_t bits = v != v ? kQuietNan : __float_as_uint(v);
  atomicMax(reinterpret_cast<unsigned int*>(at), bits);
}

struct QArgs {
  const void* q;
  int64_t stride_b, stride_h, stride_n;
  int heads_q, seqlen_q, head_dim;
  float scale_log2;
  float* out;  // (B, Hq, 2)
};

// grid (Nq_pad / 64, Hq, B), 128 threads: warp w takes rows 16w..16w+15 of the block.
template <typename T>
__global__ void __launch_bounds__(128) q_stats_kernel(const QArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hq = blockIdx.y, b = blockIdx.z;
  const T* head = static_cast<const T*>(a.q) + b * a.stride_b + hq * a.stride_h;
  float step2_max = 0.f, norm2_max = 0.f;
  for (int g = 0; g < 8; ++g) {
    float x[2][kMaxChannelsPerLane];
    float amax = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = blockIdx.x * groups::kQBlock + 16 * warp + g + 8 * h;
#pragma unroll
      for (int i = 0; i < kMaxChannelsPerLane; ++i) {
        const int c = lane + 32 * i;
        x[h][i] = row < a.seqlen_q && c < a.head_dim
                      ? common::to_float(head[static_cast<int64_t>(row) * a.stride_n + c])
                      : 0.f;
        amax = nan_max(amax, fabsf(x[h][i]));
      }
    }
    amax = warp_nan_max(amax);
    // The kernel's codes: x · (127 / amax) rounded to nearest even (|·| <= 127 already).
    const float inv = amax > 0.f ? common::kInt8Max / amax : 0.f;
    int n2[2] = {0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kMaxChannelsPerLane; ++i) {
        const int code = max(-127, min(127, __float2int_rn(__fmul_rn(x[h][i], inv))));
        n2[h] += code * code;
      }
    const float step = amax / common::kInt8Max * a.scale_log2;  // a_i, as the emulator's
    const float step2 = step * step;
    step2_max = nan_max(step2_max, step2);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      norm2_max = nan_max(norm2_max, step2 * static_cast<float>(warp_sum(n2[h])));
  }
  if (lane == 0) {
    float* out = a.out + 2 * (static_cast<int64_t>(b) * a.heads_q + hq);
    atomic_max_bits(out, step2_max);
    atomic_max_bits(out + 1, norm2_max);
  }
}

struct KArgs {
  const int8_t* k_i8;
  const float* k_scale;
  int heads_kv, nkv_pad, head_dim_padded;
  float* out;  // (B, Hkv, 2)
};

// grid (Nkv_pad / 128, Hkv, B), 128 threads: thread t takes token 128·blockIdx.x + t.
__global__ void __launch_bounds__(128) k_stats_kernel(const KArgs a) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t slice = static_cast<int64_t>(b) * a.heads_kv + h;
  const int j = blockIdx.x * groups::kKvTile + threadIdx.x;
  const int4* row = reinterpret_cast<const int4*>(a.k_i8 + (slice * a.nkv_pad + j) * a.head_dim_padded);
  int n2 = 0;
  for (int w = 0; w < a.head_dim_padded / 16; ++w) {
    const int4 v = row[w];
    n2 = __dp4a(v.x, v.x, n2);
    n2 = __dp4a(v.y, v.y, n2);
    n2 = __dp4a(v.z, v.z, n2);
    n2 = __dp4a(v.w, v.w, n2);
  }
  const int64_t per_slice = a.nkv_pad / groups::kKvTile * groups::kKThreadGroupsPerTile;
  const float step = a.k_scale[slice * per_slice + blockIdx.x * groups::kKThreadGroupsPerTile +
                               groups::k_thread_group_in_tile(j)];
  const float step2 = step * step;
  const float step2_max = warp_nan_max(step2);
  const float norm2_max = warp_nan_max(step2 * static_cast<float>(n2));
  if (threadIdx.x % 32 == 0) {
    float* out = a.out + 2 * slice;
    atomic_max_bits(out, step2_max);
    atomic_max_bits(out + 1, norm2_max);
  }
}

}  // namespace

cudaError_t launch_guard(const qattn_fwd_params& p, const KView& k, Stats out, cudaStream_t stream) {
  if (auto e = cudaMemsetAsync(out.q, 0, std::size_t(p.batch) * p.heads_q * 2 * sizeof(float), stream);
      e != cudaSuccess)
    return e;
  if (auto e = cudaMemsetAsync(out.k, 0, std::size_t(p.batch) * p.heads_kv * 2 * sizeof(float), stream);
      e != cudaSuccess)
    return e;
  constexpr float kLog2e = 1.4426950408889634f;
  const float sm_scale = p.sm_scale > 0.f ? p.sm_scale : 1.f / sqrtf(static_cast<float>(p.head_dim));
  const QArgs qa{p.q.data,   p.q.stride_b, p.q.stride_h, p.q.stride_n, p.heads_q,
                 p.seqlen_q, p.head_dim,   sm_scale * kLog2e, out.q};
  const int q_blocks = (p.seqlen_q + groups::kQBlock - 1) / groups::kQBlock;
  const dim3 q_grid(static_cast<unsigned>(q_blocks), static_cast<unsigned>(p.heads_q),
                    static_cast<unsigned>(p.batch));
  if (p.dtype == QATTN_DTYPE_BF16)
    q_stats_kernel<__nv_bfloat16><<<q_grid, 128, 0, stream>>>(qa);
  else
    q_stats_kernel<__half><<<q_grid, 128, 0, stream>>>(qa);
  if (auto e = cudaGetLastError(); e != cudaSuccess) return e;
  const KArgs ka{k.k_i8, k.k_scale, p.heads_kv, k.nkv_pad, k.head_dim_padded, out.k};
  const dim3 k_grid(static_cast<unsigned>(k.nkv_pad / groups::kKvTile),
                    static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
  k_stats_kernel<<<k_grid, 128, 0, stream>>>(ka);
  return cudaGetLastError();
}

}  // namespace qattn::guard
