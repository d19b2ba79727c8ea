// The head-dim-256 forward's Q pass: each 128-row block of Q quantized to INT8 with the
// bits of the SA2-8b kernel's in-kernel quantizer (sage2::quantize_q_row, its four-warp
// form, one row per thread, on a shared-memory copy of the block in its TMA layout),
// written to the workspace for the attention kernel's TMA loads.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sage2_fwd/quantize.cuh"
#include "cuda/sage2_fwd/q_tile.cuh"
#include "qattn/qattn.h"

namespace qattn::sage2_wide {

struct QPassParams {
  int heads_q, heads_kv, seqlen_q, head_dim, nq_pad;
  qattn_qk_granularity granularity;
  float scale_log2, sm_scale;
  const float* k_mean;  // (B, Hkv, 256): c, for q·c (null: no LSE wanted)
};

template <typename T>
cudaError_t launch_q_pass(const sage2::InputView<T>& q, const QPassParams& p, int batch,
                          const sage2::QDebugOut& out, cudaStream_t stream);

}  // namespace qattn::sage2_wide
