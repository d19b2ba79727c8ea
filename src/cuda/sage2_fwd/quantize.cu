#include <cuda_fp8.h>

#include "cuda/sage2_fwd/quantize.cuh"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {
namespace {

constexpr int kThreads = 256;
constexpr int kSmoothingSample = 256;  // tokens averaged for the K smoothing vector
constexpr float kInt8Max = 127.f;
constexpr float kE4m3Max = 448.f;
constexpr uint32_t kNaNBits = 0x7fffffff;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return __half2float(x);
}

// Reads N channels at `ch` of row `row` of a (rows x head_dim) matrix. The row is
// clamped into range so the load is unconditional (the loads of a thread's items can
// all be in flight at once) and rows past the end read as zero. With kFullDim (head_dim
// equals the padded D) every chunk is a single vector load: inputs are 16-byte aligned
// with row strides a multiple of 8 elements (the api checks).
template <bool kFullDim, typename T, int N>
__device__ __forceinline__ void load_chunk(const T* base, int64_t stride, int row, int rows, int ch,
                                           int head_dim, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "chunks of 2, 4 or 8 elements");
  const T* src = base + static_cast<int64_t>(min(row, rows - 1)) * stride + ch;
  if (kFullDim || ch + N <= head_dim) {
    using Vec = std::conditional_t<N == 8, uint4, std::conditional_t<N == 4, uint2, uint32_t>>;
    const Vec raw = *reinterpret_cast<const Vec*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = ch + j < head_dim ? to_float(src[j]) : 0.f;
  }
  if (row >= rows)
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = 0.f;
}

// NaN-propagating max of |x|: a NaN input must make its group's scale NaN.
__device__ __forceinline__ float amax_nan(float a, float x) {
  const float ax = fabsf(x);
  return (ax != ax || a != a) ? __uint_as_float(kNaNBits) : fmaxf(a, ax);
}

// Max of non-negative floats (and canonical NaN, which sorts highest) by integer bits.
__device__ __forceinline__ void atomic_amax(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

__device__ __forceinline__ uint32_t quantize_int8x4(const float* x, float inv, bool zero) {
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int q = zero ? 0 : max(-127, min(127, __float2int_rn(x[j] * inv)));
    w |= static_cast<uint32_t>(q & 0xFF) << (8 * j);
  }
  return w;
}

__device__ __forceinline__ uint32_t quantize_e4m3(float x) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// ---- 1. statistics, one launch: the K smoothing vector and the V amax ---------------------
// grid (nkv_pad / 128 + 1, Hkv, B), block 256. The last block of each head averages K
// over the token sample (in the shadow of the amax blocks, which read all of V).

// The K smoothing vector c: the mean of a sample of tokens (docs/sage2-kernel-arithmetic.md
// step 1). Thread = (channel, part): each part sums every kParts-th sampled token, the
// loads in batches of independent ones; the parts then add in a fixed order.
template <typename T, int D>
__device__ void k_mean_block(const InputView<T>& k, const QuantizeParams& p, int h, int b,
                             float* k_mean) {
  constexpr int kParts = kThreads / D;
  constexpr int kPerPart = kSmoothingSample / kParts;
  constexpr int kBatch = 32;
  __shared__ float partial[kParts][D];
  const int ch = threadIdx.x % D, part = threadIdx.x / D;
  const int n = min(p.seqlen_kv, kSmoothingSample);
  const T* base = k.data + b * k.stride_b + h * k.stride_h + ch;
  float sum = 0.f;
#pragma unroll 1
  for (int j0 = 0; j0 < kPerPart; j0 += kBatch) {
    float vals[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = part + (j0 + j) * kParts;
      const int64_t tok = p.seqlen_kv <= kSmoothingSample
                              ? i
                              : static_cast<int64_t>(i) * p.seqlen_kv / kSmoothingSample;
      vals[j] = (ch < p.head_dim && i < n) ? to_float(base[tok * k.stride_n]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) sum += vals[j];
  }
  partial[part][ch] = sum;
  __syncthreads();
  if (part == 0) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kParts; ++i) total += partial[i][ch];
    k_mean[(static_cast<int64_t>(b) * p.heads_kv + h) * D + ch] =
        ch < p.head_dim ? total / static_cast<float>(n) : 0.f;
  }
}

// Per-channel amax of V over one 128-token tile, merged into v_amax (zeroed before).
// Thread = (8-channel chunk, token lane).
template <typename T, int D, bool kFullDim>
__device__ void v_amax_block(const InputView<T>& v, const QuantizeParams& p, int tile, int h, int b,
                             float* v_amax) {
  constexpr int kChunks = D / 8, kTokStep = kThreads / kChunks, kItems = groups::kKvTile / kTokStep;
  __shared__ float chan[D];
  const int chunk = threadIdx.x % kChunks, tok0 = threadIdx.x / kChunks;
  if (threadIdx.x < D) chan[threadIdx.x] = 0.f;
  __syncthreads();
  float vals[kItems][8];
#pragma unroll
  for (int i = 0; i < kItems; ++i)
    load_chunk<kFullDim>(v.data + b * v.stride_b + h * v.stride_h, v.stride_n,
                         tile * groups::kKvTile + tok0 + i * kTokStep, p.seqlen_kv, chunk * 8,
                         p.head_dim, vals[i]);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) a = amax_nan(a, vals[i][j]);
    atomic_amax(&chan[chunk * 8 + j], a);
  }
  __syncthreads();
  if (threadIdx.x < D)
    atomic_amax(&v_amax[(static_cast<int64_t>(b) * p.heads_kv + h) * D + threadIdx.x],
                chan[threadIdx.x]);
}

template <typename T, int D, bool kFullDim>
__global__ void __launch_bounds__(kThreads)
    statistics_kernel(InputView<T> k, InputView<T> v, QuantizeParams p, float* k_mean,
                      float* v_amax) {
  const int tiles = p.nkv_pad / groups::kKvTile;
  if (blockIdx.x == tiles)
    k_mean_block<T, D>(k, p, blockIdx.y, blockIdx.z, k_mean);
  else
    v_amax_block<T, D, kFullDim>(v, p, blockIdx.x, blockIdx.y, blockIdx.z, v_amax);
}

// ---- 3. K (smoothed INT8) and V (E4M3, transposed, permuted) of one 128-token tile ---------
// grid (2 · nkv_pad / 128, Hkv, B), block 256: even blocks quantize a K tile, odd ones
// the V tile (two small CTAs keep more loads in flight than one doing both in turn).
template <typename T, int D, bool kFullDim>
__global__ void __launch_bounds__(kThreads)
    kv_quantize_kernel(InputView<T> k, InputView<T> v, QuantizeParams p, QuantizeOutputs out) {
  constexpr int kTile = groups::kKvTile;
  __shared__ float group_amax[groups::kKThreadGroupsPerTile];
  const int tile = blockIdx.x / 2, h = blockIdx.y, b = blockIdx.z;
  const bool is_k = blockIdx.x % 2 == 0;
  const int64_t bh = static_cast<int64_t>(b) * p.heads_kv + h;
  if (threadIdx.x < groups::kKThreadGroupsPerTile) group_amax[threadIdx.x] = 0.f;
  __syncthreads();

  // K. Thread: one 8-channel chunk at tokens tok0 + kTokStep·i; kTokStep is a multiple
  // of 8, so all of a thread's tokens share one per-thread group ((tok % 8) / 2).
  if (is_k) {
    constexpr int kChunks = D / 8, kTokStep = kThreads / kChunks, kItems = kTile / kTokStep;
    static_assert(kTokStep % 8 == 0, "a thread's tokens must share one K group");
    const int chunk = threadIdx.x % kChunks, tok0 = threadIdx.x / kChunks, ch0 = chunk * 8;
    float c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = out.k_mean[bh * D + ch0 + j];
    float kv[kItems][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i)
      load_chunk<kFullDim>(k.data + b * k.stride_b + h * k.stride_h, k.stride_n,
                           tile * kTile + tok0 + i * kTokStep, p.seqlen_kv, ch0, p.head_dim, kv[i]);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      // Tail tokens stay zero (outside every amax); padded channels have c = 0.
      const bool valid = tile * kTile + tok0 + i * kTokStep < p.seqlen_kv;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kv[i][j] = valid ? kv[i][j] - c[j] : 0.f;
        amax = amax_nan(amax, kv[i][j]);
      }
    }
    const bool per_thread = p.granularity == QATTN_QK_PER_THREAD;
    const int group = per_thread ? groups::k_thread_group_in_tile(tok0) : 0;
    atomic_amax(&group_amax[group], amax);
    __syncthreads();
    const float a = group_amax[group];
    const float inv = kInt8Max / a;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int tok = tile * kTile + tok0 + i * kTokStep;
      *reinterpret_cast<uint2*>(out.k_i8 + (bh * p.nkv_pad + tok) * D + ch0) = make_uint2(
          quantize_int8x4(kv[i], inv, !(a > 0.f)), quantize_int8x4(kv[i] + 4, inv, !(a > 0.f)));
    }
    if (threadIdx.x < groups::kKThreadGroupsPerTile)
      out.k_scale[bh * (p.nkv_pad / kTile * groups::kKThreadGroupsPerTile) +
                  tile * groups::kKThreadGroupsPerTile + threadIdx.x] =
          group_amax[per_thread ? threadIdx.x : 0] / kInt8Max;
  }

  // V, with its global per-channel scale: E4M3 codes go to a shared Vᵀ tile in the
  // permuted token order, then out as 16-byte rows. Tokens vary fastest across a warp,
  // so the byte stores of a warp land in few rows (bank conflicts ≤ 2-way).
  if (!is_k) {
    constexpr int kChunks = D / 8, kTokStep = kThreads / kChunks, kItems = kTile / kTokStep;
    constexpr int kPosOfToken[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
    __shared__ __align__(16) uint8_t vt[D][kTile];
    const int tok0 = threadIdx.x % kTokStep, ch0 = (threadIdx.x / kTokStep) * 8;
    float inv[8];
    bool zero[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = out.v_amax[bh * D + ch0 + j];
      inv[j] = kE4m3Max / a;
      zero[j] = !(a > 0.f);
    }
    float x[kItems][8];
#pragma unroll
    for (int i = 0; i < kItems; ++i)
      load_chunk<kFullDim>(v.data + b * v.stride_b + h * v.stride_h, v.stride_n,
                           tile * kTile + tok0 + i * kTokStep, p.seqlen_kv, ch0, p.head_dim, x[i]);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int t = tok0 + i * kTokStep;
      const int pos = (t & ~15) | kPosOfToken[t & 15];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        vt[ch0 + j][pos] = zero[j] ? 0 : static_cast<uint8_t>(quantize_e4m3(x[i][j] * inv[j]));
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < D * kTile / 16; idx += kThreads) {
      const int row = idx / (kTile / 16), col = (idx % (kTile / 16)) * 16;
      *reinterpret_cast<uint4*>(out.vt_f8 + (bh * D + row) * p.nkv_pad + tile * kTile + col) =
          *reinterpret_cast<const uint4*>(&vt[row][col]);
    }
  }
}

// ---- 4. Q (INT8, sm_scale·log2e folded into the scale) and q·c ------------------------------
// grid (nq_pad / 64, Hq, B), block 256 = 8 warps × 8 rows; a lane holds D/32 channels.
template <typename T, int D, bool kFullDim>
__global__ void __launch_bounds__(kThreads)
    q_quantize_kernel(InputView<T> q, QuantizeParams p, QuantizeOutputs out) {
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
  for (int i = 0; i < kRowsPerWarp; ++i)
    load_chunk<kFullDim>(q.data + b * q.stride_b + h * q.stride_h, q.stride_n,
                         blk * kRows + warp * kRowsPerWarp + i, p.seqlen_q, ch0, p.head_dim, x[i]);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    float a = 0.f, dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      a = amax_nan(a, x[i][j]);
      dot += x[i][j] * cv[j];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      a = amax_nan(a, __shfl_xor_sync(0xffffffff, a, off));
      dot += __shfl_xor_sync(0xffffffff, dot, off);
    }
    if (lane == 0) {
      row_amax[r] = a;
      out.q_dot_c[bh * p.nq_pad + blk * kRows + r] = p.sm_scale * dot;
    }
  }
  __syncthreads();

  // The rows sharing a scale with row r, by granularity (mma_groups.h).
  auto group_amax = [&](int r) {
    int first = 0, count = kRows, step = 1;
    if (p.granularity == QATTN_QK_PER_THREAD) {
      first = r & ~8;
      count = 2;
      step = 8;
    } else if (p.granularity == QATTN_QK_PER_WARP) {
      first = r & ~15;
      count = groups::kQWarpRows;
    }
    float a = 0.f;
    for (int i = 0; i < count; ++i) a = amax_nan(a, row_amax[first + i * step]);
    return a;
  };

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    const float a = group_amax(r);
    const float inv = kInt8Max / a;
    int8_t* dst = out.q_i8 + (bh * p.nq_pad + blk * kRows + r) * D + ch0;
    if constexpr (kPerLane == 4) {
      *reinterpret_cast<uint32_t*>(dst) = quantize_int8x4(x[i], inv, !(a > 0.f));
    } else {
      const float pair[4] = {x[i][0], x[i][1], 0.f, 0.f};
      *reinterpret_cast<uint16_t*>(dst) =
          static_cast<uint16_t>(quantize_int8x4(pair, inv, !(a > 0.f)));
    }
  }
  if (threadIdx.x < groups::kQThreadGroupsPerBlock) {
    const int gi = threadIdx.x;  // rows (gi / 8) * 16 + gi % 8 and that + 8
    const int r = (gi / 8) * groups::kQWarpRows + gi % 8;
    out.q_scale[bh * (p.nq_pad / kRows * groups::kQThreadGroupsPerBlock) +
                blk * groups::kQThreadGroupsPerBlock + gi] =
        (group_amax(r) / kInt8Max) * p.scale_log2;
  }
}

template <typename T, int D, bool kFullDim>
cudaError_t launch_quantize_passes(const InputView<T>& q, const InputView<T>& k,
                                   const InputView<T>& v, const QuantizeParams& p,
                                   const QuantizeOutputs& out, cudaStream_t stream) {
  const dim3 kv_grid(p.nkv_pad / groups::kKvTile, p.heads_kv, p.batch);
  if (cudaError_t e =
          cudaMemsetAsync(out.v_amax, 0, sizeof(float) * D * p.heads_kv * p.batch, stream);
      e != cudaSuccess)
    return e;
  statistics_kernel<T, D, kFullDim>
      <<<dim3(kv_grid.x + 1, kv_grid.y, kv_grid.z), kThreads, 0, stream>>>(k, v, p, out.k_mean,
                                                                           out.v_amax);
  kv_quantize_kernel<T, D, kFullDim>
      <<<dim3(2 * kv_grid.x, kv_grid.y, kv_grid.z), kThreads, 0, stream>>>(k, v, p, out);
  q_quantize_kernel<T, D, kFullDim>
      <<<dim3(p.nq_pad / groups::kQBlock, p.heads_q, p.batch), kThreads, 0, stream>>>(q, p, out);
  return cudaGetLastError();
}

}  // namespace

template <typename T, int D>
cudaError_t launch_quantize(const InputView<T>& q, const InputView<T>& k, const InputView<T>& v,
                            const QuantizeParams& p, const QuantizeOutputs& out,
                            cudaStream_t stream) {
  return p.head_dim == D ? launch_quantize_passes<T, D, true>(q, k, v, p, out, stream)
                         : launch_quantize_passes<T, D, false>(q, k, v, p, out, stream);
}

#define QATTN_INSTANTIATE(T, D)                                                          \
  template cudaError_t launch_quantize<T, D>(const InputView<T>&, const InputView<T>&,   \
                                             const InputView<T>&, const QuantizeParams&, \
                                             const QuantizeOutputs&, cudaStream_t);
QATTN_INSTANTIATE(__nv_bfloat16, 64)
QATTN_INSTANTIATE(__nv_bfloat16, 128)
QATTN_INSTANTIATE(__half, 64)
QATTN_INSTANTIATE(__half, 128)
#undef QATTN_INSTANTIATE

}  // namespace qattn::sage2
