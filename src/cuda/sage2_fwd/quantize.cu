#include "cuda/sage2_fwd/quantize.cuh"

#include <cuda_fp8.h>

#include "numerics/mma_groups.h"

namespace qattn::sage2 {
namespace {

constexpr int kThreads = 256;
constexpr int kSmoothingSample = 256;  // tokens averaged for the K smoothing vector
constexpr float kInt8Max = 127.f;
constexpr float kE4m3Max = 448.f;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else return __half2float(x);
}

// Reads `n` channels starting at `ch` of one row (zeros past head_dim).
template <typename T, int N>
__device__ __forceinline__ void load_row_chunk(const T* row, int ch, int head_dim, float (&out)[N]) {
  if (ch + N <= head_dim && (N * sizeof(T)) % 16 == 0) {
    // Inputs are 16-byte aligned with strides a multiple of 8 elements (api checks).
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + ch + i);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[i + j] = to_float(e[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = ch + i < head_dim ? to_float(row[ch + i]) : 0.f;
  }
}

// NaN-propagating |x| max: a NaN input must make its group's scale NaN.
__device__ __forceinline__ float amax_nan(float a, float x) {
  const float ax = fabsf(x);
  return (ax != ax || a != a) ? __int_as_float(0x7fffffff) : fmaxf(a, ax);
}

// Shared-memory max of non-negative floats (and NaN) through their integer bits.
__device__ __forceinline__ void atomic_amax(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));  // NaN 0x7fffffff sorts highest
}

__device__ __forceinline__ int8_t quantize_int8(float x, float inv_scale) {
  const int q = __float2int_rn(x * inv_scale);
  return static_cast<int8_t>(max(-127, min(127, q)));
}

__device__ __forceinline__ uint8_t quantize_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// ---- 1. the K smoothing vector: mean over a sample of tokens ---------------------------
// grid (Hkv, B), block D: one thread per channel, summing in token order (FP32).
template <typename T, int D>
__global__ void k_mean_kernel(InputView<T> k, QuantizeParams p, float* k_mean) {
  const int h = blockIdx.x, b = blockIdx.y, ch = threadIdx.x;
  const int n = min(p.seqlen_kv, kSmoothingSample);
  const T* base = k.data + b * k.stride_b + h * k.stride_h;
  float sum = 0.f;
  if (ch < p.head_dim) {
    for (int i = 0; i < n; ++i) {
      const int64_t tok = p.seqlen_kv <= kSmoothingSample
                              ? i
                              : static_cast<int64_t>(i) * p.seqlen_kv / kSmoothingSample;
      sum += to_float(base[tok * k.stride_n + ch]);
    }
    sum = sum / static_cast<float>(n);
  }
  k_mean[(static_cast<int64_t>(b) * p.heads_kv + h) * D + ch] = sum;
}

// ---- 2. K (smoothed INT8) and V (E4M3, transposed) of one 128-token tile -----------------
// grid (nkv_pad / 128, Hkv, B), block 256. Thread: one 8-channel chunk, tokens
// tok0 + kTokStep * i; with kTokStep a multiple of 8 all its tokens share one K
// per-thread group ((tok % 8) / 2).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) kv_quantize_kernel(InputView<T> k, InputView<T> v,
                                                               QuantizeParams p, QuantizeOutputs out) {
  constexpr int kTile = groups::kKvTile;
  constexpr int kChunks = D / 8;
  constexpr int kTokStep = kThreads / kChunks;  // 16 (D=128) or 32 (D=64)
  constexpr int kItems = kTile / kTokStep;      // 8 or 4
  static_assert(kTokStep % 8 == 0, "a thread's tokens must share one K group");

  __shared__ float group_amax[groups::kKThreadGroupsPerTile];
  __shared__ float chan_amax[D];
  __shared__ __align__(16) uint8_t vt_tile[D][kTile];

  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_kv + h;
  const int chunk = threadIdx.x % kChunks, tok0 = threadIdx.x / kChunks;
  const int ch0 = chunk * 8;
  if (threadIdx.x < groups::kKThreadGroupsPerTile) group_amax[threadIdx.x] = 0.f;
  if (threadIdx.x < D) chan_amax[threadIdx.x] = 0.f;
  __syncthreads();

  // K: subtract c, find the group amax, quantize.
  float c[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) c[j] = out.k_mean[bh * D + ch0 + j];
  float kv[kItems][8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int tok = tile * kTile + tok0 + i * kTokStep;
    if (tok < p.seqlen_kv) {
      load_row_chunk<T, 8>(k.data + b * k.stride_b + h * k.stride_h + tok * k.stride_n, ch0,
                           p.head_dim, kv[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) kv[i][j] = ch0 + j < p.head_dim ? kv[i][j] - c[j] : 0.f;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) kv[i][j] = 0.f;  // tail tokens are zero, outside every amax
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = amax_nan(amax, kv[i][j]);
  }
  const bool per_thread = p.granularity == QATTN_QK_PER_THREAD;
  const int group = per_thread ? groups::k_thread_group_in_tile(tok0) : 0;
  atomic_amax(&group_amax[group], amax);
  __syncthreads();
  {
    const float a = group_amax[group];
    const float inv = kInt8Max / a;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int tok = tile * kTile + tok0 + i * kTokStep;
      uint32_t packed[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t w = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int8_t q = a > 0.f ? quantize_int8(kv[i][half * 4 + j], inv) : int8_t{0};
          w |= static_cast<uint32_t>(static_cast<uint8_t>(q)) << (8 * j);
        }
        packed[half] = w;
      }
      *reinterpret_cast<uint2*>(out.k_i8 + (bh * p.nkv_pad + tok) * D + ch0) =
          make_uint2(packed[0], packed[1]);
    }
  }
  if (threadIdx.x < groups::kKThreadGroupsPerTile) {
    const float a = group_amax[per_thread ? threadIdx.x : 0];
    out.k_scale[bh * (p.nkv_pad / kTile * groups::kKThreadGroupsPerTile) +
                tile * groups::kKThreadGroupsPerTile + threadIdx.x] = a / kInt8Max;
  }

  // V: per-channel amax over the tile, E4M3, written transposed in the permuted order.
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int tok = tile * kTile + tok0 + i * kTokStep;
    if (tok < p.seqlen_kv)
      load_row_chunk<T, 8>(v.data + b * v.stride_b + h * v.stride_h + tok * v.stride_n, ch0,
                           p.head_dim, kv[i]);
    else
#pragma unroll
      for (int j = 0; j < 8; ++j) kv[i][j] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) a = amax_nan(a, kv[i][j]);
    atomic_amax(&chan_amax[ch0 + j], a);
  }
  __syncthreads();
  // Position of token (tok % 16) inside its group of 16 in Vᵀ (inverse of kVPermute16).
  constexpr int kPosOfToken[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = chan_amax[ch0 + j];
    const float inv = kE4m3Max / a;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int t = tok0 + i * kTokStep;
      vt_tile[ch0 + j][(t & ~15) | kPosOfToken[t & 15]] = a > 0.f ? quantize_e4m3(kv[i][j] * inv) : 0;
    }
  }
  if (threadIdx.x < D)
    out.v_scale[(bh * (p.nkv_pad / kTile) + tile) * D + threadIdx.x] = chan_amax[threadIdx.x] / kE4m3Max;
  __syncthreads();
  for (int idx = threadIdx.x; idx < D * kTile / 16; idx += kThreads) {
    const int row = idx / (kTile / 16), col = (idx % (kTile / 16)) * 16;
    *reinterpret_cast<uint4*>(out.vt_f8 + (bh * D + row) * p.nkv_pad + tile * kTile + col) =
        *reinterpret_cast<const uint4*>(&vt_tile[row][col]);
  }
}

// ---- 3. Q (INT8, sm_scale·log2e folded into the scale) and q·c ----------------------------
// grid (nq_pad / 64, Hq, B), block 256 = 8 warps x 8 rows; lane: D/32 channels.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) q_quantize_kernel(InputView<T> q, QuantizeParams p,
                                                              QuantizeOutputs out) {
  constexpr int kRows = groups::kQBlock;
  constexpr int kRowsPerWarp = kRows / (kThreads / 32);
  constexpr int kPerLane = D / 32;
  __shared__ float row_amax[kRows];

  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_q + h;
  const int hkv = h / (p.heads_q / p.heads_kv);
  const float* c = out.k_mean + (static_cast<int64_t>(b) * p.heads_kv + hkv) * D;
  const int ch0 = lane * kPerLane;
  float cv[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) cv[j] = c[ch0 + j];

  float x[kRowsPerWarp][kPerLane];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    const int row = blk * kRows + r;
    if (row < p.seqlen_q) {
      const T* src = q.data + b * q.stride_b + h * q.stride_h + row * q.stride_n;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) x[i][j] = ch0 + j < p.head_dim ? to_float(src[ch0 + j]) : 0.f;
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) x[i][j] = 0.f;
    }
    float a = 0.f, dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      a = amax_nan(a, x[i][j]);
      dot += x[i][j] * cv[j];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffff, a, off);
      a = (o != o || a != a) ? __int_as_float(0x7fffffff) : fmaxf(a, o);
      dot += __shfl_xor_sync(0xffffffff, dot, off);
    }
    if (lane == 0) {
      row_amax[r] = a;
      out.q_dot_c[bh * p.nq_pad + row] = p.sm_scale * dot;
    }
  }
  __syncthreads();

  // The rows sharing a scale with row r, by granularity (mma_groups.h).
  auto group_amax = [&](int r) {
    int first = r, count = 1, step = 1;
    if (p.granularity == QATTN_QK_PER_THREAD) { first = r & ~8; count = 2; step = 8; }
    else if (p.granularity == QATTN_QK_PER_WARP) { first = r & ~15; count = groups::kQWarpRows; }
    else { first = 0; count = kRows; }
    float a = 0.f;
    for (int i = 0; i < count; ++i) {
      const float v = row_amax[first + i * step];
      a = (v != v || a != a) ? __int_as_float(0x7fffffff) : fmaxf(a, v);
    }
    return a;
  };

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    const float a = group_amax(r);
    const float inv = kInt8Max / a;
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int8_t v = a > 0.f ? quantize_int8(x[i][j], inv) : int8_t{0};
      w |= static_cast<uint32_t>(static_cast<uint8_t>(v)) << (8 * j);
    }
    int8_t* dst = out.q_i8 + (bh * p.nq_pad + blk * kRows + r) * D + ch0;
    if constexpr (kPerLane == 4) *reinterpret_cast<uint32_t*>(dst) = w;
    else *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w);
  }
  if (threadIdx.x < groups::kQThreadGroupsPerBlock) {
    const int gi = threadIdx.x;  // rows (gi / 8) * 16 + gi % 8 and that + 8
    const int r = (gi / 8) * groups::kQWarpRows + gi % 8;
    out.q_scale[bh * (p.nq_pad / kRows * groups::kQThreadGroupsPerBlock) +
                blk * groups::kQThreadGroupsPerBlock + gi] = (group_amax(r) / kInt8Max) * p.scale_log2;
  }
}

}  // namespace

template <typename T, int D>
cudaError_t launch_quantize(const InputView<T>& q, const InputView<T>& k, const InputView<T>& v,
                            const QuantizeParams& p, const QuantizeOutputs& out, cudaStream_t stream) {
  k_mean_kernel<T, D><<<dim3(p.heads_kv, p.batch), D, 0, stream>>>(k, p, out.k_mean);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  kv_quantize_kernel<T, D>
      <<<dim3(p.nkv_pad / groups::kKvTile, p.heads_kv, p.batch), kThreads, 0, stream>>>(k, v, p, out);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  q_quantize_kernel<T, D>
      <<<dim3(p.nq_pad / groups::kQBlock, p.heads_q, p.batch), kThreads, 0, stream>>>(q, p, out);
  return cudaGetLastError();
}

#define QATTN_INSTANTIATE(T, D)                                                                 \
  template cudaError_t launch_quantize<T, D>(const InputView<T>&, const InputView<T>&,          \
                                             const InputView<T>&, const QuantizeParams&,        \
                                             const QuantizeOutputs&, cudaStream_t);
QATTN_INSTANTIATE(__nv_bfloat16, 64)
QATTN_INSTANTIATE(__nv_bfloat16, 128)
QATTN_INSTANTIATE(__half, 64)
QATTN_INSTANTIATE(__half, 128)
#undef QATTN_INSTANTIATE

}  // namespace qattn::sage2
