// What the SageAttention3 NVFP4 forward's kernels share: the call's arguments as the
// kernels read them (strides in elements, padded lengths, the workspace's sections).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/quant_math.cuh"
#include "cuda/sage3_fwd/workspace.h"
#include "qattn/qattn.h"

namespace qattn::sage3 {

inline constexpr int kMaxHeadDim = 128;

struct WorkspacePtrs {
  float* k_mean;
  __nv_bfloat16 *k_hat, *v_hat, *q_hat;
  float *q_bar, *q_dot_c;
};

struct Args {
  qattn_tensor q, k, v, o;
  float* lse;
  int32_t dtype;
  int batch, heads_q, heads_kv, group, nq, nkv, d;
  int nq_pad, nkv_pad, q_blocks;  // padded lengths; Q blocks of 64 rows in nq_pad
  int causal;                     // bottom-right aligned: row i sees keys j <= i + nkv - nq
  float sm_scale, scale_log2;
  WorkspacePtrs ws;
};

using common::to_float;  // a 16-bit input element as float

// The quantization kernels (quantize.cu), in order, on `stream`.
cudaError_t launch_quantize(const Args& a, cudaStream_t stream);

}  // namespace qattn::sage3
