// The SageAttention3 NVFP4 forward's quantization kernels (src/emulate/sage3.cpp, steps
// 1-3): the K mean c, NVFP4(K − c) along d, NVFP4(V) along the tokens, and per 64-row
// Q block its mean q̄, NVFP4(Q − q̄) along d and each row's q·c. Means and dot products
// run in FP64 and round to FP32 once, as the emulator's do (the means in its order), so
// every quantized value here is the emulator's, bit for bit; the block scales and
// codes come from the numerics layer that the emulator uses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sage3_fwd/quantize.cuh"
#include "numerics/block_scale.h"
#include "numerics/formats.h"

namespace qattn::sage3 {
namespace {

using numerics::amax_accumulate;
using numerics::e2m1_decode;
using numerics::e4m3_decode;
using numerics::fp4_element_code;
using numerics::nvfp4_scale_code;

// The NVFP4 block of 16 values x (in place: x becomes the dequantized values, E2M1 ×
// E4M3 scale, exact in BF16).
__device__ __forceinline__ void nvfp4_block(float (&x)[kFp4Block]) {
  float amax = 0.0f;
#pragma unroll
  for (float v : x) amax = amax_accumulate(amax, v);
  const float s = e4m3_decode(nvfp4_scale_code(amax));
#pragma unroll
  for (float& v : x) v = e2m1_decode(fp4_element_code(v, s)) * s;
}

template <typename T>
__global__ void k_mean_kernel(const Args a) {
  const int bh = blockIdx.x, b = bh / a.heads_kv, h = bh % a.heads_kv;
  const T* k = static_cast<const T*>(a.k.data) + b * a.k.stride_b + h * a.k.stride_h;
  for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
    double sum = 0.0;
#pragma unroll 8
    for (int j = 0; j < a.nkv; ++j) sum = __dadd_rn(sum, to_float(k[j * a.k.stride_n + e]));
    a.ws.k_mean[int64_t{bh} * a.d + e] = static_cast<float>(sum / a.nkv);
  }
}

// One thread per (b, hkv, token, 16-element block); tokens past Nkv are zero rows.
template <typename T>
__global__ void k_quant_kernel(const Args a, int64_t items) {
  const int64_t it = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (it >= items) return;
  const int blocks = a.d / kFp4Block;
  const int blk = static_cast<int>(it % blocks);
  const int64_t row = it / blocks;  // (b·Hkv + h)·Nkv_pad + j
  const int j = static_cast<int>(row % a.nkv_pad);
  const int64_t bh = row / a.nkv_pad;
  const int b = static_cast<int>(bh / a.heads_kv), h = static_cast<int>(bh % a.heads_kv);
  float x[kFp4Block] = {};
  if (j < a.nkv) {
    const T* k = static_cast<const T*>(a.k.data) + b * a.k.stride_b + h * a.k.stride_h +
                 j * a.k.stride_n + blk * kFp4Block;
    const float* c = a.ws.k_mean + bh * a.d + blk * kFp4Block;
#pragma unroll
    for (int i = 0; i < kFp4Block; ++i) x[i] = __fsub_rn(to_float(k[i]), c[i]);
    nvfp4_block(x);
  }
  __nv_bfloat16* out = a.ws.k_hat + row * a.d + blk * kFp4Block;
#pragma unroll
  for (int i = 0; i < kFp4Block; i += 2)
    *reinterpret_cast<__nv_bfloat162*>(out + i) = __floats2bfloat162_rn(x[i], x[i + 1]);
}

// One thread per (b, hkv, 16-token block, channel): V's blocks run along the tokens.
template <typename T>
__global__ void v_quant_kernel(const Args a, int64_t items) {
  const int64_t it = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (it >= items) return;
  const int e = static_cast<int>(it % a.d);
  const int64_t tb = it / a.d;  // (b·Hkv + h)·(Nkv_pad / 16) + token block
  const int tblocks = a.nkv_pad / kFp4Block;
  const int j0 = static_cast<int>(tb % tblocks) * kFp4Block;
  const int64_t bh = tb / tblocks;
  const int b = static_cast<int>(bh / a.heads_kv), h = static_cast<int>(bh % a.heads_kv);
  const T* v = static_cast<const T*>(a.v.data) + b * a.v.stride_b + h * a.v.stride_h + e;
  float x[kFp4Block];
#pragma unroll
  for (int i = 0; i < kFp4Block; ++i)
    x[i] = j0 + i < a.nkv ? to_float(v[(j0 + i) * a.v.stride_n]) : 0.0f;
  nvfp4_block(x);
  __nv_bfloat16* out = a.ws.v_hat + (bh * a.nkv_pad + j0) * a.d + e;
#pragma unroll
  for (int i = 0; i < kFp4Block; ++i) out[int64_t{i} * a.d] = __float2bfloat16_rn(x[i]);
}

// One CTA per (Q block, query head, batch entry).
template <typename T>
__global__ void q_prep_kernel(const Args a) {
  __shared__ float s_mean[kMaxHeadDim];
  const int mb = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const int r0 = mb * kQBlock, rows = min(kQBlock, a.nq - r0);
  const int64_t bh = int64_t{b} * a.heads_q + hq;
  const T* q = static_cast<const T*>(a.q.data) + b * a.q.stride_b + hq * a.q.stride_h;
  for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
    double sum = 0.0;
    for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, to_float(q[(r0 + r) * a.q.stride_n + e]));
    const float mean = static_cast<float>(sum / rows);
    s_mean[e] = mean;
    a.ws.q_bar[(bh * a.q_blocks + mb) * a.d + e] = mean;
  }
  __syncthreads();
  const int blocks = a.d / kFp4Block;
  for (int it = threadIdx.x; it < kQBlock * blocks; it += blockDim.x) {
    const int r = it / blocks, blk = it % blocks;
    float x[kFp4Block] = {};
    if (r < rows) {
      const T* src = q + (r0 + r) * a.q.stride_n + blk * kFp4Block;
#pragma unroll
      for (int i = 0; i < kFp4Block; ++i)
        x[i] = __fsub_rn(to_float(src[i]), s_mean[blk * kFp4Block + i]);
      nvfp4_block(x);
    }
    __nv_bfloat16* out = a.ws.q_hat + (bh * a.nq_pad + r0 + r) * a.d + blk * kFp4Block;
#pragma unroll
    for (int i = 0; i < kFp4Block; i += 2)
      *reinterpret_cast<__nv_bfloat162*>(out + i) = __floats2bfloat162_rn(x[i], x[i + 1]);
  }
  // q·c of each row (unsmoothed q; the emulator's dot_rows): a warp per row, its lanes
  // across d, the FP64 sum rounded to FP32 once.
  const float* c = a.ws.k_mean + (int64_t{b} * a.heads_kv + hq / a.group) * a.d;
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < kQBlock; r += blockDim.x / 32) {
    double dot = 0.0;
    if (r < rows)
      for (int e = lane; e < a.d; e += 32)
        dot = __dadd_rn(dot, __dmul_rn(to_float(q[(r0 + r) * a.q.stride_n + e]), c[e]));
    for (int off = 16; off > 0; off >>= 1)
      dot = __dadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, off));
    if (lane == 0) a.ws.q_dot_c[bh * a.nq_pad + r0 + r] = static_cast<float>(dot);
  }
}

template <typename T>
cudaError_t launch_typed(const Args& a, cudaStream_t stream) {
  k_mean_kernel<T><<<a.batch * a.heads_kv, 128, 0, stream>>>(a);
  const int64_t bh_kv = int64_t{a.batch} * a.heads_kv;
  const int64_t k_items = bh_kv * a.nkv_pad * (a.d / kFp4Block);
  k_quant_kernel<T><<<static_cast<unsigned>((k_items + 255) / 256), 256, 0, stream>>>(a, k_items);
  const int64_t v_items = bh_kv * (a.nkv_pad / kFp4Block) * a.d;
  v_quant_kernel<T><<<static_cast<unsigned>((v_items + 255) / 256), 256, 0, stream>>>(a, v_items);
  const int used_q_blocks = (a.nq + kQBlock - 1) / kQBlock;  // blocks with a row
  q_prep_kernel<T><<<dim3(used_q_blocks, a.heads_q, a.batch), 128, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize(const Args& a, cudaStream_t stream) {
  return a.dtype == QATTN_DTYPE_FP16 ? launch_typed<__half>(a, stream)
                                     : launch_typed<__nv_bfloat16>(a, stream);
}

}  // namespace qattn::sage3
