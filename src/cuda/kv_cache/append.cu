// The KV-cache append on the GPU (docs/kv-cache.md, "Append"): the new tokens' K and V,
// each row quantized on its own into its page slot, byte for byte as the host emulation
// (emulate::append) writes it. Three kernels on the caller's stream:
//  1. k_mean (PREFILL_MEAN without a preset c): for each entry whose length is 0, c = the
//     mean of this append's keys over the token sample, in double, in the emulator's order.
//  2. append: one CTA per (tile of new tokens, batch entry), all heads, K and V; W lanes
//     per row (8 elements each, one 16-byte load), so a warp quantizes 32/W rows at once.
//  3. advance_lengths: lengths[b] += n_new, once every CTA of 2 has read lengths[b].
// Each re-checks entry b on the device (length within the capacity, every block-table
// entry the tokens need inside the pool) and touches nothing of b when it fails. 2 and 3
// start early (programmatic dependent launch) and wait for the kernel before them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/common/e4m3.cuh"
#include "cuda/common/nvfp4_scale.cuh"
#include "cuda/common/quant_math.cuh"
#include "cuda/hopper/early_launch.h"
#include "cuda/hopper/sync.cuh"
#include "cuda/kv_cache/append_math.h"
#include "cuda/kv_cache/launch.h"
#include "kvcache/layout.h"
#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/nvfp4_code.h"
#include "numerics/token_sample.h"

namespace qattn::kv_cache {
namespace {

using kvcache::KvFormat;
using kvcache::KvPageLayout;

constexpr int kThreads = 256;
constexpr int kElems = 8;  // elements per lane: one 16-byte load of 16-bit input
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Tokens per append CTA grow until the grid has about this many CTAs (four per SM of a
// 132-SM H100/H200): each CTA checks all block-table entries of its batch entry, so
// fewer, larger CTAs keep that check a small part of the traffic (at page size 1 and 32K
// tokens, 128 KB of L2 reads per CTA).
constexpr int64_t kTargetCtas = 512;
// The k_mean kernel stages the sample in chunks of this many 16-bit elements (32 KB).
constexpr int kStageElems = 16384;
constexpr int kSampleTokens = static_cast<int>(numerics::kSmoothSampleTokens);

struct Input {
  const void* data;
  int64_t stride_b, stride_h, stride_n;  // elements; 0 for a dimension of extent 1
};

struct AppendArgs {
  Input k, v;
  uint8_t* pages;
  const int32_t* block_tables;  // [batch][max_pages_per_seq]
  int32_t* lengths;             // [batch]
  float* k_mean;                // [batch][heads][head_dim]; nullptr without smoothing (c = 0)
  KvPageLayout layout;
  int32_t heads, head_dim, page_size, num_pages, max_pages_per_seq, n_new;
  FastDiv by_page;  // t / page_size (positions are below the capacity, 2^30)
  int32_t tokens_per_cta;
  bool k_mean_vec;  // k_mean is 16-byte aligned: c is read four floats at a time
};

// Whether entry b takes its n_new tokens at length len: the length fits the capacity and
// every block-table entry the tokens need is a page of the pool. The host mirrors, when
// given, were checked before the launch; these are the device values. Every thread of
// the CTA calls it (it synchronizes unless len itself is out of range, which all see).
__device__ bool entry_fits(const AppendArgs& a, int b, int32_t len) {
  const int64_t capacity = int64_t{a.max_pages_per_seq} * a.page_size;
  if (len < 0 || int64_t{len} + a.n_new > capacity) return false;
  const int32_t* row = a.block_tables + int64_t{b} * a.max_pages_per_seq;
  const auto first = static_cast<int>(a.by_page.div(static_cast<uint32_t>(len)));
  const auto last = static_cast<int>(a.by_page.div(static_cast<uint32_t>(len + a.n_new - 1)));
  bool bad = false;
  for (int i = first + static_cast<int>(threadIdx.x); i <= last;
       i += static_cast<int>(blockDim.x)) {
    const int32_t page = row[i];
    bad |= page < 0 || page >= a.num_pages;
  }
  return !__syncthreads_or(bad);
}

// A 16-bit input value as the emulation sees it: fp16 NaN as numerics::fp16_from_bits
// gives it (the canonical quiet NaN; the conversion instruction's NaN differs), bf16 by
// its bits. Only the mean and BF16 rows keep NaN bits; the other formats skip this.
template <typename T>
__device__ __forceinline__ float canonical_fp16_nan(float x) {
  if constexpr (std::is_same_v<T, __half>)
    return x != x ? numerics::detail::float_of(numerics::detail::kF32QuietNaN) : x;
  else
    return x;
}

template <typename T, bool kNaNBits>
__device__ __forceinline__ void widen8(const uint4& raw, float (&x)[kElems]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = common::widen_pair<T>(w[j]);
    x[2 * j] = kNaNBits ? canonical_fp16_nan<T>(f.x) : f.x;
    x[2 * j + 1] = kNaNBits ? canonical_fp16_nan<T>(f.y) : f.y;
  }
}

// ---- 1. the prefill mean -------------------------------------------------------------
// grid (heads, batch), block 256. numerics::token_mean(MeanEstimate::Sampled): rows
// sampled_row(i, n) for i < min(n, 256), each channel summed in double in that order,
// divided by the count in double, cast to float. The sample is staged in shared memory
// (every load of a chunk in flight at once); thread c < head_dim sums channel c.
template <typename T>
__global__ void __launch_bounds__(kThreads) k_mean_kernel(AppendArgs a) {
  hopper::launch_dependents();  // the append kernel may launch; it waits for this grid
  const int h = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.y);
  const int32_t len = a.lengths[b];
  if (len != 0) return;  // c was fixed by the sequence's first append
  if (!entry_fits(a, b, len)) return;
  __shared__ uint4 stage[kStageElems / kElems];
  const T* stage_elems = reinterpret_cast<const T*>(stage);
  const int d = a.head_dim, chunks = d / kElems;
  const int count = min(a.n_new, kSampleTokens);
  const int rows_per_stage = kStageElems / d;
  const T* base = static_cast<const T*>(a.k.data) + b * a.k.stride_b + h * a.k.stride_h;
  double sum = 0.0;
  for (int i0 = 0; i0 < count; i0 += rows_per_stage) {
    const int rows = min(rows_per_stage, count - i0);
    for (int j = threadIdx.x; j < rows * chunks; j += kThreads) {
      const int64_t r = numerics::sampled_row(i0 + j / chunks, a.n_new);
      stage[j] = __ldg(reinterpret_cast<const uint4*>(base + r * a.k.stride_n) + j % chunks);
    }
    __syncthreads();
    if (threadIdx.x < d)
      for (int i = 0; i < rows; ++i) {
        const float x = canonical_fp16_nan<T>(common::to_float(stage_elems[i * d + threadIdx.x]));
        sum = host_add(sum, host_widen(x));
      }
    __syncthreads();
  }
  if (threadIdx.x < d)
    a.k_mean[(int64_t{b} * a.heads + h) * d + threadIdx.x] =
        host_to_float(host_div(sum, static_cast<double>(count)));
}

// ---- 2. the rows -----------------------------------------------------------------------

// numerics::e4m3_encode of two products: the hardware conversion rounds the magnitude
// (RNE, saturating at 448); the sign and the NaN code 0x7F are set here, so -0 and NaN do
// not depend on the instruction's choices.
__device__ __forceinline__ uint32_t e4m3_codes2(float p0, float p1) {
  const uint32_t mag = common::quantize_e4m3x2(fminf(fabsf(p0), numerics::kE4M3Max),
                                               fminf(fabsf(p1), numerics::kE4M3Max));
  auto finish = [](uint32_t m, float p) {
    if (p != p) return uint32_t{numerics::kE4M3NaN};
    return m | ((__float_as_uint(p) >> 24) & 0x80u);
  };
  return finish(mag & 0xFFu, p0) | (finish((mag >> 8) & 0xFFu, p1) << 8);
}

// numerics::int8_quantize(x, mult) as a byte: clamp(rne(p), ±127), NaN -> 0. Clamping
// first keeps p where the FADD rounding of int8_byte_rn is exact.
__device__ __forceinline__ uint32_t int8_code(float x, float mult) {
  const float p = __fmul_rn(x, mult);
  if (p != p) return 0u;
  return common::int8_byte_rn(fminf(fmaxf(p, -common::kInt8Max), common::kInt8Max)) & 0xFFu;
}

// numerics::amax_accumulate over values, on their |x| bits: as unsigned integers they
// order like |x| with every NaN above inf, so one integer max per value; amax_of turns
// the maximum back into the float amax_accumulate gives (its canonical NaN for a NaN).
__device__ __forceinline__ uint32_t abs_bits_max(const float (&x)[kElems]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kElems; ++j) m = max(m, __float_as_uint(x[j]) & 0x7FFFFFFFu);
  return m;
}
__device__ __forceinline__ float amax_of(uint32_t m) {
  return __uint_as_float(m > 0x7F800000u ? numerics::detail::kF32QuietNaN : m);
}

// The maximum over each aligned group of kLanes lanes (a power of two).
template <int kLanes>
__device__ __forceinline__ uint32_t group_max(uint32_t m) {
#pragma unroll
  for (int off = kLanes / 2; off >= 1; off /= 2) m = max(m, __shfl_xor_sync(kFullMask, m, off));
  return m;
}

// numerics::linear_scale(amax, qmax) with the host's NaN: a NaN amax (the canonical one
// amax_accumulate returns) divides to itself on the host.
__device__ __forceinline__ float linear_scale(float amax, float qmax) {
  return amax != amax ? amax : __fdiv_rn(amax, qmax);
}

// Quantizes the lane's 8 elements of one row and, when `active`, stores its codes (lane
// q covers elements [8q, 8q + 8)) and its part of the row's scales. Every lane of the
// warp calls it (the row reductions shuffle).
template <KvFormat F, int W>
__device__ __forceinline__ void quantize_store(const float (&x)[kElems], int q, bool active,
                                               uint8_t* codes, uint8_t* scales) {
  if constexpr (F == KvFormat::NvFp4) {
    // A 16-element block is the lane pair (2i, 2i + 1).
    const float am = amax_of(group_max<2>(abs_bits_max(x)));
    float s;
    const uint8_t sc = common::nvfp4_scale(am, s);
    uint32_t packed = 0;  // element 2i in the low nibble of byte i
    if (s > 0.f) {        // s = 0 or NaN: fp4_element_code gives 0 for every element
      const numerics::Nvfp4Steps steps = numerics::nvfp4_steps(s);
#pragma unroll
      for (int j = 0; j < kElems; ++j) packed |= numerics::nvfp4_code(x[j], steps) << (4 * j);
    }
    if (active) {
      reinterpret_cast<uint32_t*>(codes)[q] = packed;
      if (q % 2 == 0) scales[q / 2] = sc;
    }
  } else if constexpr (F == KvFormat::Fp8E4M3 || F == KvFormat::Int8) {
    constexpr bool kFp8 = F == KvFormat::Fp8E4M3;
    constexpr float kQmax = kFp8 ? numerics::kE4M3Max : common::kInt8Max;
    const float am = amax_of(group_max<W>(abs_bits_max(x)));
    const float mult = numerics::linear_multiplier(am, kQmax);
    uint32_t word[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      if constexpr (kFp8) {
        word[w] = e4m3_codes2(__fmul_rn(x[4 * w], mult), __fmul_rn(x[4 * w + 1], mult)) |
                  (e4m3_codes2(__fmul_rn(x[4 * w + 2], mult), __fmul_rn(x[4 * w + 3], mult)) << 16);
      } else {
        word[w] = int8_code(x[4 * w], mult) | (int8_code(x[4 * w + 1], mult) << 8) |
                  (int8_code(x[4 * w + 2], mult) << 16) | (int8_code(x[4 * w + 3], mult) << 24);
      }
    }
    if (active) {
      reinterpret_cast<uint2*>(codes)[q] = make_uint2(word[0], word[1]);
      if (q == 0) *reinterpret_cast<float*>(scales) = linear_scale(am, kQmax);
    }
  } else {
    uint32_t word[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      word[j] = uint32_t{numerics::bf16_bits(x[2 * j])} |
                (uint32_t{numerics::bf16_bits(x[2 * j + 1])} << 16);
    if (active) reinterpret_cast<uint4*>(codes)[q] = make_uint4(word[0], word[1], word[2], word[3]);
  }
}

// x − c (FP32, RNE). With kNaNBits a NaN result gets the host's bits (host_sub); the
// other formats code every NaN alike, so the plain subtraction does.
template <bool kNaNBits>
__device__ __forceinline__ void smooth(float (&x)[kElems], const float (&c)[kElems]) {
  float r[kElems];
  bool nan = false;
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    r[j] = __fsub_rn(x[j], c[j]);
    nan |= r[j] != r[j];
  }
  if (kNaNBits && nan) {
#pragma unroll
    for (int j = 0; j < kElems; ++j) r[j] = host_sub(x[j], c[j]);
  }
#pragma unroll
  for (int j = 0; j < kElems; ++j) x[j] = r[j];
}

// c[8q .. 8q + 8) of entry b, head h.
__device__ __forceinline__ void load_c(const AppendArgs& a, int b, int h, int q,
                                       float (&c)[kElems]) {
  const float* src = a.k_mean + (int64_t{b} * a.heads + h) * a.head_dim + q * kElems;
  if (a.k_mean_vec) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(src));
    const float4 hi = __ldg(reinterpret_cast<const float4*>(src) + 1);
    c[0] = lo.x, c[1] = lo.y, c[2] = lo.z, c[3] = lo.w;
    c[4] = hi.x, c[5] = hi.y, c[6] = hi.z, c[7] = hi.w;
  } else {
#pragma unroll
    for (int j = 0; j < kElems; ++j) c[j] = __ldg(src + j);
  }
}

// grid (tiles, batch), block 256. The CTA's rows are (head, K or V, token) for its
// tokens, token fastest, so the rows a warp handles together are neighbouring slots.
template <typename T, KvFormat F, int W>
__global__ void __launch_bounds__(kThreads) append_kernel(AppendArgs a) {
  static_assert(W >= 2 && W <= 32 && (W & (W - 1)) == 0);
  constexpr int kRowsPerWarp = 32 / W;
  constexpr int kRowsPerPass = kThreads / W;
  hopper::grid_dependency_wait();  // k, v, k_mean and lengths are the kernels' before us
  hopper::launch_dependents();
  const int b = static_cast<int>(blockIdx.y);
  const int32_t len = a.lengths[b];
  if (!entry_fits(a, b, len)) return;
  const int r0 = static_cast<int>(blockIdx.x) * a.tokens_per_cta;
  const int tokens = min(a.tokens_per_cta, a.n_new - r0);
  const int rows = 2 * a.heads * tokens;
  const FastDiv by_tokens = make_fast_div(static_cast<uint32_t>(tokens));
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int q = lane % W;  // the lane's 8-element chunk of its row
  const bool in_row = q < a.head_dim / kElems;
  const KvPageLayout& lay = a.layout;
  const int32_t* table = a.block_tables + int64_t{b} * a.max_pages_per_seq;

  for (int first = static_cast<int>(threadIdx.x / 32) * kRowsPerWarp; first < rows;
       first += kRowsPerPass) {
    const int i = first + lane / W;
    const bool active = in_row && i < rows;
    float x[kElems] = {};
    uint8_t *codes = nullptr, *scales = nullptr;
    if (active) {
      const auto hk = static_cast<int>(by_tokens.div(static_cast<uint32_t>(i)));
      const int r = r0 + (i - hk * tokens);
      const int h = hk / 2;
      const bool is_v = hk % 2 == 1;
      // Field by field: selecting a whole Input would take the parameter's address.
      const T* src = static_cast<const T*>(is_v ? a.v.data : a.k.data) +
                     b * (is_v ? a.v.stride_b : a.k.stride_b) +
                     h * (is_v ? a.v.stride_h : a.k.stride_h) +
                     r * (is_v ? a.v.stride_n : a.k.stride_n) + q * kElems;
      constexpr bool kNaNBits = F == KvFormat::Bf16;  // the row stores x's bits
      widen8<T, kNaNBits>(__ldg(reinterpret_cast<const uint4*>(src)), x);
      if (!is_v && a.k_mean != nullptr) {
        float c[kElems];
        load_c(a, b, h, q, c);
        smooth<kNaNBits>(x, c);
      }
      const auto t = static_cast<uint32_t>(len + r);
      const uint32_t entry = a.by_page.div(t);
      const auto slot = static_cast<int>(t - entry * static_cast<uint32_t>(a.page_size));
      uint8_t* page = a.pages + int64_t{table[entry]} * lay.page_bytes;
      codes = page + lay.code_offset(is_v, slot, h);
      scales = page + lay.scale_offset(is_v, slot, h);
    }
    quantize_store<F, W>(x, q, active, codes, scales);
  }
}

// ---- 3. the lengths ------------------------------------------------------------------
constexpr int kLengthThreads = 128;

__global__ void __launch_bounds__(kLengthThreads) advance_lengths_kernel(AppendArgs a) {
  hopper::grid_dependency_wait();  // every append CTA has read lengths[b]
  const int b = static_cast<int>(blockIdx.x);
  const int32_t len = a.lengths[b];
  if (entry_fits(a, b, len) && threadIdx.x == 0) a.lengths[b] = len + a.n_new;
}

// ---- launch --------------------------------------------------------------------------

// Lanes per row: the power of two that holds head_dim / 8 chunks.
int lanes_per_row(int head_dim) {
  int w = 2;
  while (w * kElems < head_dim) w *= 2;
  return w;
}

using Kernel = void (*)(AppendArgs);

template <typename T, KvFormat F>
Kernel append_kernel_for(int w) {
  switch (w) {
    case 2:
      return append_kernel<T, F, 2>;
    case 4:
      return append_kernel<T, F, 4>;
    case 8:
      return append_kernel<T, F, 8>;
    case 16:
      return append_kernel<T, F, 16>;
    default:
      return append_kernel<T, F, 32>;
  }
}

template <typename T>
Kernel append_kernel_for(KvFormat f, int w) {
  switch (f) {
    case KvFormat::NvFp4:
      return append_kernel_for<T, KvFormat::NvFp4>(w);
    case KvFormat::Fp8E4M3:
      return append_kernel_for<T, KvFormat::Fp8E4M3>(w);
    case KvFormat::Int8:
      return append_kernel_for<T, KvFormat::Int8>(w);
    case KvFormat::Bf16:
      break;
  }
  return append_kernel_for<T, KvFormat::Bf16>(w);
}

template <typename T>
cudaError_t launch_typed(const AppendArgs& a, KvFormat format, int batch, bool mean,
                         cudaStream_t stream) {
  if (mean) {
    k_mean_kernel<T><<<dim3(a.heads, batch), kThreads, 0, stream>>>(a);
    // Checked on its own, so a failed launch enqueues nothing after it.
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  const int tiles = (a.n_new + a.tokens_per_cta - 1) / a.tokens_per_cta;
  const Kernel kernel = append_kernel_for<T>(format, lanes_per_row(a.head_dim));
  const dim3 grid(tiles, batch);
  if (mean) {
    if (cudaError_t e = hopper::early_launch(kernel, grid, dim3(kThreads), 0, stream, a);
        e != cudaSuccess)
      return e;
  } else {
    kernel<<<grid, kThreads, 0, stream>>>(a);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return hopper::early_launch(advance_lengths_kernel, dim3(batch), dim3(kLengthThreads), 0, stream,
                              a);
}

Input input_of(const qattn_tensor& t, int32_t batch, int32_t heads, int32_t n) {
  // A dimension of extent 1 has no stride (qattn_tensor's rule): its index is always 0.
  return {t.data, batch > 1 ? t.stride_b : 0, heads > 1 ? t.stride_h : 0, n > 1 ? t.stride_n : 0};
}

}  // namespace

int launch_append(const qattn_kv_append_params& p, const qattn_kv_cache& c, void* stream) {
  AppendArgs a{};
  a.k = input_of(p.k, p.batch, c.heads_kv, p.n_new);
  a.v = input_of(p.v, p.batch, c.heads_kv, p.n_new);
  a.pages = static_cast<uint8_t*>(c.pages);
  a.block_tables = p.seqs.block_tables;
  a.lengths = p.seqs.lengths;
  const bool smoothed = c.k_smoothing == QATTN_KV_SMOOTH_PREFILL_MEAN;
  a.k_mean = smoothed ? p.seqs.k_mean : nullptr;
  a.k_mean_vec = reinterpret_cast<uintptr_t>(a.k_mean) % 16 == 0;
  const auto format = static_cast<KvFormat>(c.format);
  a.layout = kvcache::page_layout(format, c.heads_kv, c.head_dim, c.page_size);
  a.heads = c.heads_kv;
  a.head_dim = c.head_dim;
  a.page_size = c.page_size;
  a.num_pages = c.num_pages;
  a.max_pages_per_seq = c.max_pages_per_seq;
  a.n_new = p.n_new;
  a.by_page = make_fast_div(static_cast<uint32_t>(c.page_size));
  // Enough tokens per CTA to fill one pass of its warps, more when the grid would exceed
  // kTargetCtas.
  const int64_t rows_per_pass = kThreads / lanes_per_row(c.head_dim);
  int64_t tokens = (rows_per_pass + 2 * c.heads_kv - 1) / (2 * c.heads_kv);
  tokens = std::max(tokens, (int64_t{p.n_new} * p.batch + kTargetCtas - 1) / kTargetCtas);
  // A CTA's row count, 2 · heads · tokens, stays an int.
  tokens = std::min(tokens, (int64_t{1} << 29) / c.heads_kv);
  a.tokens_per_cta = static_cast<int32_t>(std::clamp<int64_t>(tokens, 1, p.n_new));
  const bool mean = smoothed && p.k_mean_preset == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return p.dtype == QATTN_DTYPE_BF16 ? launch_typed<__nv_bfloat16>(a, format, p.batch, mean, s)
                                     : launch_typed<__half>(a, format, p.batch, mean, s);
}

}  // namespace qattn::kv_cache
