// The SageBwd backward's passes around the main kernels (prepare.cu):
//   k_mean (over the forward's token sample) -> k_prepare (smoothed K, Kᵀ, V per KV tile)
//   -> q_prepare (Q, Qᵀ, dO, dOᵀ per Q block; lse2, delta; zeroes the dQ accumulators)
//   ... dkdv / dq kernels ...  -> dq_finalize (the FP32 dQ to 16-bit).
#pragma once

#include <cuda_runtime.h>

#include "cuda/sagebwd/args.h"
#include "cuda/sagebwd/format8.cuh"

namespace qattn::sagebwd {

// Each enqueues its kernel for the 16-bit type T (__half or __nv_bfloat16) and padded
// head dim D (64 or 128); returns cudaGetLastError(). launch_prepare writes the 8-bit
// operands in `code`'s format.
template <typename T, int D>
cudaError_t launch_prepare(const Args& a, bool quant_dov, Code8 code, cudaStream_t stream);
template <typename T, int D>
cudaError_t launch_dq_finalize(const Args& a, cudaStream_t stream);

}  // namespace qattn::sagebwd
