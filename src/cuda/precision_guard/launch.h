// The precision guard on the GPU (precision "auto"): the per-head maxima of
// numerics/precision_guard.h gathered from the caller's Q (here) and the SA2-8b K
// quantizer's INT8 K (sage2_fwd/quantize.cu), without a host synchronization. The 16-bit
// forward then reads them and runs only the heads the rule flags (cuda/precise_fwd/launch.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/precision_guard/stats.h"
#include "qattn/qattn.h"

namespace qattn::guard {

// Zeroes the Q maxima ((B, Hq, 2) floats) and enqueues the pass over the caller's Q on
// `stream`; returns cudaSuccess or the first CUDA error; never synchronizes. The K maxima
// come from the SA2-8b forward (sage2::launch_forward's guard_k).
cudaError_t launch_q_maxima(const qattn_fwd_params& p, float* q_maxima, cudaStream_t stream);

}  // namespace qattn::guard
