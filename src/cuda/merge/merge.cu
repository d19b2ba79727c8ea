// The merge of one partial attention output into a running FP32 accumulator by their
// natural-log LSEs (qattn.h, qattn_merge): a warp per query row, each lane a strided
// set of the row's channels. Memory-bound; the arithmetic is FP32 with IEEE exp/log
// (expf/logf, not the fast intrinsics), the same rule as qattn.distributed.merge_partials.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/quant_math.cuh"
#include "cuda/merge/launch.h"

namespace qattn::merge {
namespace {

constexpr int kWarps = 8;  // rows per CTA

template <typename T>
__device__ __forceinline__ T store16(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return __float2half_rn(x);
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) merge_kernel(qattn_merge_params p) {
  const int64_t rows = int64_t{p.batch} * p.heads * p.seqlen;
  const int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int n = static_cast<int>(row % p.seqlen);
  const int64_t bh = row / p.seqlen;
  const int h = static_cast<int>(bh % p.heads), b = static_cast<int>(bh / p.heads);
  // Dimensions of extent one may carry any stride (the api never multiplies them).
  const int64_t sb = p.batch > 1 ? p.part.stride_b : 0, sh = p.heads > 1 ? p.part.stride_h : 0,
                sn = p.seqlen > 1 ? p.part.stride_n : 0;
  const T* part = static_cast<const T*>(p.part.data) + b * sb + h * sh + n * sn;
  float* acc = p.acc + row * p.head_dim;
  const float lp = p.part_lse[row];
  float wa = 0.f, wp = 1.f, lse = lp;  // the first part: the accumulator becomes it
  if (!p.first) {
    const float la = p.acc_lse[row];
    const float m = fmaxf(la, lp);
    if (m == -INFINITY) {  // no part saw a key: O = 0, LSE = -inf
      wa = wp = 0.f;
      lse = -INFINITY;
    } else {
      wa = expf(la - m);  // exp(-inf) = 0: a part that saw no key adds nothing
      wp = expf(lp - m);
      const float total = wa + wp;
      wa /= total;
      wp /= total;
      lse = m + logf(total);
    }
  } else if (lp == -INFINITY) {
    wp = 0.f;  // a row that sees no key: O = 0 (whatever the part holds)
  }
  T* out = nullptr;
  if (p.out.data != nullptr) {
    const int64_t ob = p.batch > 1 ? p.out.stride_b : 0, oh = p.heads > 1 ? p.out.stride_h : 0,
                  on = p.seqlen > 1 ? p.out.stride_n : 0;
    out = static_cast<T*>(p.out.data) + b * ob + h * oh + n * on;
  }
  for (int c = lane; c < p.head_dim; c += 32) {
    const float o = (p.first ? 0.f : wa * acc[c]) + wp * common::to_float(part[c]);
    acc[c] = o;
    if (out != nullptr) out[c] = store16<T>(o);
  }
  if (lane == 0) p.acc_lse[row] = lse;
}

}  // namespace

int launch_merge(const qattn_merge_params& p, void* stream) {
  const int64_t rows = int64_t{p.batch} * p.heads * p.seqlen;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  if (blocks > INT32_MAX) return static_cast<int>(cudaErrorInvalidConfiguration);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == QATTN_DTYPE_BF16)
    merge_kernel<__nv_bfloat16><<<static_cast<unsigned>(blocks), kWarps * 32, 0, s>>>(p);
  else
    merge_kernel<__half><<<static_cast<unsigned>(blocks), kWarps * 32, 0, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace qattn::merge
