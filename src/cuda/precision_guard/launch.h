// The precision guard on the GPU (precision "auto", issue 22): the per-head maxima of
// numerics/precision_guard.h gathered from the caller's Q and the SA2-8b workspace's
// INT8 K, without a host synchronization. The 16-bit forward then reads them and runs
// only the heads the rule flags (cuda/precise_fwd/launch.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/precision_guard/stats.h"
#include "qattn/qattn.h"

namespace qattn::guard {

// What the guard reads of the SA2-8b workspace: the smoothed INT8 K (B·Hkv slices of
// nkv_pad rows of `head_dim_padded` bytes) and its per-thread-group steps (amax / 127,
// nkv_pad / 128 · 4 per slice).
struct KView {
  const int8_t* k_i8;
  const float* k_scale;
  int nkv_pad, head_dim_padded;
};

// Zeroes the maxima and enqueues the two gathering kernels on `stream`; returns
// cudaSuccess or the first CUDA error; never synchronizes.
cudaError_t launch_guard(const qattn_fwd_params& p, const KView& k, Stats out, cudaStream_t stream);

}  // namespace qattn::guard
