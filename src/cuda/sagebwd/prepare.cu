// Preprocessing and finishing passes of the SageBwd backward (prepare.cuh). Memory
// bound; each reads its inputs once or twice (the second read hits L2).
#include "cuda/sagebwd/prepare.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/quant_math.cuh"
#include "cuda/sagebwd/format8.cuh"
#include "cuda/sagebwd/out_stores.cuh"
#include "cuda/sagebwd/permute.cuh"
#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/token_sample.h"

namespace qattn::sagebwd {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ const T* row_ptr(const Strided& t, int b, int h, int n) {
  return static_cast<const T*>(t.data) + b * t.sb + h * t.sh + static_cast<int64_t>(n) * t.sn;
}

// Elements c0..c0+7 of a row as floats; 0 past d (never read past d).
template <typename T>
__device__ __forceinline__ void load8(const T* row, int c0, int d, float (&x)[8]) {
  if (c0 + 8 <= d) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + c0);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = common::widen_pair<T>(w[i]);
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = c0 + i < d ? common::to_float(row[c0 + i]) : 0.0f;
  }
}

// The raw 16 bytes of elements c0..c0+7, zeros past d.
template <typename T>
__device__ __forceinline__ uint4 load8_raw(const T* row, int c0, int d) {
  if (c0 + 8 <= d) return *reinterpret_cast<const uint4*>(row + c0);
  uint4 out = make_uint4(0, 0, 0, 0);
  T* e = reinterpret_cast<T*>(&out);
  for (int i = 0; i < 8; ++i)
    if (c0 + i < d) e[i] = row[c0 + i];
  return out;
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32;
  __syncthreads();  // red may still be read from an earlier call
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
  return m;
}

// max into a float that holds a non-negative value (merge-free channel maxima, zeroed by
// k_mean_kernel): non-negative floats order as their bit patterns.
__device__ __forceinline__ void atomic_max_nonneg(float* at, float v) {
  atomicMax(reinterpret_cast<int*>(at), __float_as_int(v));
}

// Raises out[c0..c0+7] to the CTA's maxima of its threads' v (threads of equal c0 hold
// other rows): reduced in `scratch` (kThreads·8 floats) first, so a CTA sends one atomic a
// column, not one a thread and column; those pile onto a head's few cache lines, where
// they serialize (bench/NOTES.md v94). Every thread calls it.
template <int D>
__device__ __forceinline__ void cta_column_max(const float (&v)[8], int c0, float* out,
                                               float* scratch) {
  constexpr int kRows = kThreads / (D / 8);  // threads a column
  const int r = threadIdx.x / (D / 8);
#pragma unroll
  for (int i = 0; i < 8; ++i) scratch[r * D + c0 + i] = v[i];
  __syncthreads();
  if (threadIdx.x < D) {
    float m = scratch[threadIdx.x];
#pragma unroll 4
    for (int k = 1; k < kRows; ++k) m = fmaxf(m, scratch[k * D + threadIdx.x]);
    atomic_max_nonneg(out + threadIdx.x, m);
  }
  __syncthreads();  // scratch may be written again
}

// |x| as FP16 (the emulator's fp16_round: the merge-free bound reads dO and V in FP16).
__device__ __forceinline__ float abs_fp16(float x) { return fabsf(__half2float(__float2half_rn(x))); }

// Eight values times inv as the format's codes, low byte first: the emulator's
// (numerics::int8_quantize or e4m3_encode of x·inv).
template <Code8 C>
__device__ __forceinline__ uint2 pack8(const float (&x)[8], float inv) {
  if constexpr (!Format8<C>::kIntegerSums) {
    using F = Format8<C>;
    return make_uint2(F::pack4(x[0], x[1], x[2], x[3], inv), F::pack4(x[4], x[5], x[6], x[7], inv));
  }
  uint2 r;
  r.x = 0;
  r.y = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r.x |= (static_cast<uint32_t>(static_cast<uint8_t>(numerics::int8_quantize(x[i], inv)))) << (8 * i);
    r.y |= (static_cast<uint32_t>(static_cast<uint8_t>(numerics::int8_quantize(x[4 + i], inv))))
           << (8 * i);
  }
  return r;
}

// Column `col` of rows 16g..16g+15 of an 8-bit tile in shared memory (row stride kBt),
// the rows in the order at(0..15) names (permute.cuh's), as one 16-byte word: a row of a
// transposed operand.
template <typename At>
__device__ __forceinline__ uint4 column_word(const uint8_t* tile, int kBt, int g, int col, At&& at) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[i] |= static_cast<uint32_t>(tile[(16 * g + at(4 * i + k)) * kBt + col]) << (8 * k);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- K side ------------------------------------------------------------------------

// The smoothing vector c: the mean of K over the forward's token sample (every token up
// to 256, else 256 spread evenly; numerics/token_sample.h), so the backward's scores are
// smoothed as the training forward's were. Summed in FP64 row by row, as the emulator's
// numerics::token_mean, so c is its FP32 rounding of the mean bit for bit.
template <typename T, int D>
__global__ void __launch_bounds__(D) k_mean_kernel(Args a) {
  const int h = blockIdx.x % a.heads_kv, b = blockIdx.x / a.heads_kv, col = threadIdx.x;
  const int64_t n = a.nkv < numerics::kSmoothSampleTokens ? a.nkv : numerics::kSmoothSampleTokens;
  double s = 0.0;
  if (col < a.d) {
    const T* base = row_ptr<T>(a.k, b, h, 0) + col;
    for (int64_t i = 0; i < n; ++i)
      s += common::to_float(base[numerics::sampled_row(i, a.nkv) * a.k.sn]);
  }
  a.k_mean[static_cast<int64_t>(blockIdx.x) * D + col] =
      col < a.d ? static_cast<float>(s / static_cast<double>(n)) : 0.0f;
  if (a.v_max != nullptr) {  // merge-free: the channel maxima the prepare passes raise
    a.v_max[static_cast<int64_t>(blockIdx.x) * D + col] = 0.0f;
    a.do_max[static_cast<int64_t>(blockIdx.x) * D + col] = 0.0f;
    a.sq_max[static_cast<int64_t>(blockIdx.x) * D + col] = 0.0f;
  }
}

template <typename T, int D, bool kQuantDov, Code8 C>
__global__ void __launch_bounds__(kThreads) k_prepare_kernel(Args a) {
  constexpr float kMax = Format8<C>::kMax;
  constexpr int kTpr = D / 8, kRpp = kThreads / kTpr, kPasses = kKvTileRows / kRpp;
  constexpr int kBt = D + 8;  // byte tile row stride (8-byte aligned rows)
  __shared__ uint8_t bt[kKvTileRows * kBt];
  __shared__ float red[kThreads / 32];
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int j0 = tile * kKvTileRows, tiles = a.nkv_pad / kKvTileRows;
  const int64_t bh = static_cast<int64_t>(b) * a.heads_kv + h;
  const int c0 = (threadIdx.x % kTpr) * 8, r_in = threadIdx.x / kTpr;
  const float* c = a.k_mean + bh * D;
  float cm[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) cm[i] = c[c0 + i];

  float amax_k = 0.0f, amax_v = 0.0f, vmax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r_in + p * kRpp, n = j0 + r;
    uint4 vraw = make_uint4(0, 0, 0, 0);
    if (n < a.nkv) {
      float x[8];
      load8(row_ptr<T>(a.k, b, h, n), c0, a.d, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax_k = fmaxf(amax_k, fabsf(x[i] - cm[i]));
      const T* vrow = row_ptr<T>(a.v, b, h, n);
      vraw = load8_raw(vrow, c0, a.d);
      if constexpr (Format8<C>::kMergeFree) {
        float y[8];
        load8(vrow, c0, a.d, y);
#pragma unroll
        for (int i = 0; i < 8; ++i) vmax[i] = fmaxf(vmax[i], abs_fp16(y[i]));
      }
      if constexpr (kQuantDov) {
        float y[8];
        load8(vrow, c0, a.d, y);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax_v = fmaxf(amax_v, fabsf(y[i]));
      }
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(a.v_16) + (bh * a.nkv_pad + n) * D + c0) = vraw;
  }
  if constexpr (Format8<C>::kMergeFree) {
    __shared__ float scratch[kThreads * 8];
    cta_column_max<D>(vmax, c0, a.v_max + bh * D, scratch);
  }
  amax_k = block_max(amax_k, red);
  if constexpr (kQuantDov) amax_v = block_max(amax_v, red);
  const float inv_k = numerics::linear_multiplier(amax_k, kMax);
  const float inv_v = numerics::linear_multiplier(amax_v, kMax);
  if (threadIdx.x == 0) {
    a.k_scale[bh * tiles + tile] = numerics::linear_scale(amax_k, kMax);
    if constexpr (kQuantDov) a.v_scale[bh * tiles + tile] = numerics::linear_scale(amax_v, kMax);
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r_in + p * kRpp, n = j0 + r;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (n < a.nkv) {
      load8(row_ptr<T>(a.k, b, h, n), c0, a.d, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = c0 + i < a.d ? x[i] - cm[i] : 0.0f;
    }
    const uint2 q = pack8<C>(x, inv_k);
    *reinterpret_cast<uint2*>(a.k_i8 + (bh * a.nkv_pad + n) * D + c0) = q;
    *reinterpret_cast<uint2*>(bt + r * kBt + c0) = q;
    if constexpr (kQuantDov) {
      float y[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (n < a.nkv) load8(row_ptr<T>(a.v, b, h, n), c0, a.d, y);
      *reinterpret_cast<uint2*>(a.v_i8 + (bh * a.nkv_pad + n) * D + c0) = pack8<C>(y, inv_v);
    }
  }
  __syncthreads();
  // Kᵀ: row `col` holds the tile's 128 tokens in the σ order of dQ's reduction
  // (permute.cuh).
  for (int chunk = threadIdx.x; chunk < D * (kKvTileRows / 16); chunk += kThreads) {
    const int col = chunk / (kKvTileRows / 16), g = chunk % (kKvTileRows / 16);
    *reinterpret_cast<uint4*>(a.kt_i8 + (bh * D + col) * a.nkv_pad + j0 + 16 * g) =
        column_word(bt, kBt, g, col, [](int r) { return kv_token_at(r); });
  }
}

// ---- Q side ------------------------------------------------------------------------

// Qᵀ and dOᵀ of Q block r0 of (b, h) from its 8-bit rows in shared memory (row stride
// kBt), rows permuted in groups of 16 (permute.cuh). After a barrier on the rows.
template <int D>
__device__ __forceinline__ void store_q_transposes(const Args& a, const uint8_t* bt_q,
                                                   const uint8_t* bt_do, int64_t bh, int r0) {
  constexpr int kBt = D + 8;
  for (int chunk = threadIdx.x; chunk < 2 * D * (kQBlockRows / 16); chunk += kThreads) {
    const int which = chunk / (D * (kQBlockRows / 16)), rest = chunk % (D * (kQBlockRows / 16));
    const int col = rest / (kQBlockRows / 16), g = rest % (kQBlockRows / 16);
    int8_t* dst = which == 0 ? a.qt_i8 : a.dot_i8;
    *reinterpret_cast<uint4*>(dst + (bh * D + col) * a.nq_pad + r0 + 16 * g) =
        column_word(which == 0 ? bt_q : bt_do, kBt, g, col, [](int r) { return k_slot_row(r); });
  }
}

template <typename T, int D, bool kQuantDov, Code8 C>
__global__ void __launch_bounds__(kThreads) q_prepare_kernel(Args a) {
  constexpr float kMax = Format8<C>::kMax;
  constexpr int kTpr = D / 8, kRpp = kThreads / kTpr, kPasses = kQBlockRows / kRpp;
  constexpr int kBt = D + 8;
  __shared__ uint8_t bt_q[kQBlockRows * kBt];
  __shared__ uint8_t bt_do[kQBlockRows * kBt];
  __shared__ float red[kThreads / 32];
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.group;
  const int r0 = blk * kQBlockRows, blocks = a.nq_pad / kQBlockRows;
  const int64_t bh = static_cast<int64_t>(b) * a.heads_q + h;
  const int c0 = (threadIdx.x % kTpr) * 8, r_in = threadIdx.x / kTpr;
  const float* c = a.k_mean + (static_cast<int64_t>(b) * a.heads_kv + hk) * D;
  float cm[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) cm[i] = c[c0 + i];

  constexpr bool kMergeFree = Format8<C>::kMergeFree;
  float amax_q = 0.0f, amax_do = 0.0f;
  // Merge-free: V's channel maxima (k_prepare_kernel's), and this thread's maxima of |dO|
  // and |s_i·Q| over its rows, for the group's (atomics below).
  float vmax[8] = {0, 0, 0, 0, 0, 0, 0, 0}, domax[8] = {0, 0, 0, 0, 0, 0, 0, 0},
        sqmax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t bhk = static_cast<int64_t>(b) * a.heads_kv + hk;
  if constexpr (kMergeFree) {
#pragma unroll
    for (int i = 0; i < 8; ++i) vmax[i] = a.v_max[bhk * D + c0 + i];
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r_in + p * kRpp, n = r0 + r;
    float qc = 0.0f, dsum = 0.0f, bound = 0.0f;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0}, g[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint4 doraw = make_uint4(0, 0, 0, 0);
    if (n < a.nq) {
      float o[8];
      load8(row_ptr<T>(a.q, b, h, n), c0, a.d, x);
      const T* dorow = row_ptr<T>(a.dout, b, h, n);
      load8(dorow, c0, a.d, g);
      load8(row_ptr<T>(a.o, b, h, n), c0, a.d, o);
      doraw = load8_raw(dorow, c0, a.d);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        amax_q = fmaxf(amax_q, fabsf(x[i]));
        amax_do = fmaxf(amax_do, fabsf(g[i]));
        qc = fmaf(x[i], cm[i], qc);
        dsum = fmaf(g[i], o[i], dsum);
        if constexpr (kMergeFree) bound = fmaf(abs_fp16(g[i]), vmax[i], bound);
      }
    }
#pragma unroll
    for (int off = 1; off < kTpr; off <<= 1) {
      qc += __shfl_xor_sync(0xffffffffu, qc, off);
      dsum += __shfl_xor_sync(0xffffffffu, dsum, off);
      if constexpr (kMergeFree) bound += __shfl_xor_sync(0xffffffffu, bound, off);
    }
    if constexpr (kMergeFree) {
      // s_i: the bound of row i's largest |dS| (the emulator's step b); 0 for a padding
      // row and for a row whose P is 0 everywhere (p_max 0: it sees no key).
      const float pm = n < a.nq ? a.p_max[bh * a.nq + n] : 0.0f;
      const float s = pm > 0.0f ? (bound + fabsf(dsum)) * pm / Format8<C>::kMax : 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        domax[i] = fmaxf(domax[i], fabsf(g[i]));
        sqmax[i] = fmaxf(sqmax[i], fabsf(s * x[i]));
      }
      if (threadIdx.x % kTpr == 0) {
        a.s_row[bh * a.nq_pad + n] = s;
        a.inv_s[bh * a.nq_pad + n] = s > 0.0f ? 1.0f / s : 0.0f;
      }
    }
    if (threadIdx.x % kTpr == 0) {
      float l2 = INFINITY;  // padding rows: P = exp2(x - inf) = 0
      if (n < a.nq) l2 = (a.lse[bh * a.nq + n] - a.sm_scale * qc) * static_cast<float>(M_LOG2E);
      a.lse2[bh * a.nq_pad + n] = l2;
      a.delta[bh * a.nq_pad + n] = dsum;
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(a.do_16) + (bh * a.nq_pad + n) * D + c0) = doraw;
    float4* acc = reinterpret_cast<float4*>(a.dq_acc + (bh * a.nq_pad + n) * D + c0);
    acc[0] = make_float4(0, 0, 0, 0);
    acc[1] = make_float4(0, 0, 0, 0);
  }
  if constexpr (kMergeFree) {
    __shared__ float scratch[kThreads * 8];
    cta_column_max<D>(domax, c0, a.do_max + bhk * D, scratch);
    cta_column_max<D>(sqmax, c0, a.sq_max + bhk * D, scratch);
  }
  amax_q = block_max(amax_q, red);
  amax_do = block_max(amax_do, red);
  const float inv_q = numerics::linear_multiplier(amax_q, kMax);
  const float inv_do = numerics::linear_multiplier(amax_do, kMax);
  if (threadIdx.x == 0) {
    a.q_scale[bh * blocks + blk] = numerics::linear_scale(amax_q, kMax);
    a.do_scale[bh * blocks + blk] = numerics::linear_scale(amax_do, kMax);
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r_in + p * kRpp, n = r0 + r;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0}, g[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (n < a.nq) {
      load8(row_ptr<T>(a.q, b, h, n), c0, a.d, x);
      load8(row_ptr<T>(a.dout, b, h, n), c0, a.d, g);
    }
    const uint2 qq = pack8<C>(x, inv_q), qd = pack8<C>(g, inv_do);
    *reinterpret_cast<uint2*>(a.q_i8 + (bh * a.nq_pad + n) * D + c0) = qq;
    *reinterpret_cast<uint2*>(bt_q + r * kBt + c0) = qq;
    *reinterpret_cast<uint2*>(bt_do + r * kBt + c0) = qd;
    if constexpr (kQuantDov) *reinterpret_cast<uint2*>(a.do_i8 + (bh * a.nq_pad + n) * D + c0) = qd;
  }
  if constexpr (Format8<C>::kMergeFree) return;  // q_codes_kernel writes Qᵀ and dOᵀ
  __syncthreads();
  store_q_transposes<D>(a, bt_q, bt_do, bh, r0);
}

// The merge-free Qᵀ and dOᵀ (workspace.h): E4M3(s_i·Q_ic / s_Q',c) and E4M3(dO_ic / s_dO,c)
// with the group's channel maxima q_prepare_kernel left, as the emulator's steps c, d
// (the same products and quotients, so the same codes).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) q_codes_kernel(Args a) {
  using F = Format8<Code8::E4M3MergeFree>;
  constexpr int kTpr = D / 8, kRpp = kThreads / kTpr, kPasses = kQBlockRows / kRpp;
  constexpr int kBt = D + 8;
  __shared__ uint8_t bt_q[kQBlockRows * kBt];
  __shared__ uint8_t bt_do[kQBlockRows * kBt];
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.group;
  const int r0 = blk * kQBlockRows;
  const int64_t bh = static_cast<int64_t>(b) * a.heads_q + h;
  const int64_t bhk = static_cast<int64_t>(b) * a.heads_kv + hk;
  const int c0 = (threadIdx.x % kTpr) * 8, r_in = threadIdx.x / kTpr;
  float s_q[8], s_do[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s_q[i] = a.sq_max[bhk * D + c0 + i] / F::kMax;
    s_do[i] = a.do_max[bhk * D + c0 + i] / F::kMax;
  }
  auto code_of = [](float x, float scale) { return scale > 0.0f ? __fdiv_rn(x, scale) : 0.0f; };
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r_in + p * kRpp, n = r0 + r;
    float x[8] = {0, 0, 0, 0, 0, 0, 0, 0}, g[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (n < a.nq) {
      load8(row_ptr<T>(a.q, b, h, n), c0, a.d, x);
      load8(row_ptr<T>(a.dout, b, h, n), c0, a.d, g);
    }
    const float s = a.s_row[bh * a.nq_pad + n];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = code_of(__fmul_rn(s, x[i]), s_q[i]);
      g[i] = code_of(g[i], s_do[i]);
    }
    *reinterpret_cast<uint2*>(bt_q + r * kBt + c0) = pack8<Code8::E4M3MergeFree>(x, 1.0f);
    *reinterpret_cast<uint2*>(bt_do + r * kBt + c0) = pack8<Code8::E4M3MergeFree>(g, 1.0f);
  }
  __syncthreads();
  store_q_transposes<D>(a, bt_q, bt_do, bh, r0);
}

// ---- dQ ----------------------------------------------------------------------------

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) dq_finalize_kernel(Args a) {
  constexpr int kTpr = D / 8, kRpp = kThreads / kTpr, kPasses = kQBlockRows / kRpp;
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * a.heads_q + h;
  const int c0 = (threadIdx.x % kTpr) * 8, r_in = threadIdx.x / kTpr;
  // A thread's 8 columns in one 16-byte store where the rows allow it.
  const bool whole = rows_aligned<T, 16>(a.dq) && c0 + 8 <= a.d;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int n = blk * kQBlockRows + r_in + p * kRpp;
    if (n >= a.nq) continue;
    // Already sm_scale·Σ ψ(dS)ψ(K)·s; 32-byte aligned (D floats a row, c0 a multiple of 8).
    // The merge-free scales leave the row's s_i to apply here.
    const float* acc_in = a.dq_acc + (bh * a.nq_pad + n) * D + c0;
    const float4 lo = *reinterpret_cast<const float4*>(acc_in);
    const float4 hi = *reinterpret_cast<const float4*>(acc_in + 4);
    float acc[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    if (a.s_row != nullptr) {
      const float s_i = a.s_row[bh * a.nq_pad + n];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= s_i;
    }
    T* out = static_cast<T*>(a.dq.data) + b * a.dq.sb + h * a.dq.sh + static_cast<int64_t>(n) * a.dq.sn;
    if (whole) {
      *reinterpret_cast<uint4*>(out + c0) = make_uint4(
          pack2<T>(acc[0], acc[1]), pack2<T>(acc[2], acc[3]), pack2<T>(acc[4], acc[5]),
          pack2<T>(acc[6], acc[7]));
      continue;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c0 + i >= a.d) break;
      store_out(out + c0 + i, acc[i]);
    }
  }
}

template <typename T, int D, bool kQuantDov, Code8 C>
void enqueue_prepare(const Args& a, cudaStream_t stream) {
  const int tiles = a.nkv_pad / kKvTileRows, blocks = a.nq_pad / kQBlockRows;
  k_prepare_kernel<T, D, kQuantDov, C><<<dim3(tiles, a.heads_kv, a.batch), kThreads, 0, stream>>>(a);
  q_prepare_kernel<T, D, kQuantDov, C><<<dim3(blocks, a.heads_q, a.batch), kThreads, 0, stream>>>(a);
  if constexpr (Format8<C>::kMergeFree)
    q_codes_kernel<T, D><<<dim3(blocks, a.heads_q, a.batch), kThreads, 0, stream>>>(a);
}

}  // namespace

template <typename T, int D>
cudaError_t launch_prepare(const Args& a, bool quant_dov, Code8 code, cudaStream_t stream) {
  k_mean_kernel<T, D><<<a.batch * a.heads_kv, D, 0, stream>>>(a);
  if (code == Code8::E4M3MergeFree) {
    enqueue_prepare<T, D, false, Code8::E4M3MergeFree>(a, stream);  // dov 16-bit only
  } else if (code == Code8::E4M3) {
    quant_dov ? enqueue_prepare<T, D, true, Code8::E4M3>(a, stream)
              : enqueue_prepare<T, D, false, Code8::E4M3>(a, stream);
  } else {
    quant_dov ? enqueue_prepare<T, D, true, Code8::Int8>(a, stream)
              : enqueue_prepare<T, D, false, Code8::Int8>(a, stream);
  }
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_dq_finalize(const Args& a, cudaStream_t stream) {
  dq_finalize_kernel<T, D><<<dim3(a.nq_pad / kQBlockRows, a.heads_q, a.batch), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

#define QATTN_SAGEBWD_PREPARE(T, D)                                                   \
  template cudaError_t launch_prepare<T, D>(const Args&, bool, Code8, cudaStream_t); \
  template cudaError_t launch_dq_finalize<T, D>(const Args&, cudaStream_t);
QATTN_SAGEBWD_PREPARE(__half, 64)
QATTN_SAGEBWD_PREPARE(__half, 128)
QATTN_SAGEBWD_PREPARE(__nv_bfloat16, 64)
QATTN_SAGEBWD_PREPARE(__nv_bfloat16, 128)
#undef QATTN_SAGEBWD_PREPARE

}  // namespace qattn::sagebwd
