// Host entry point of the SageAttention3 NVFP4 forward for Hopper (sm_90a): NVFP4 Q
// and K with smoothing, two-level NVFP4 P, NVFP4 V, each product formed from the
// dequantized operands on BF16 tensor cores (an E2M1 value times an E4M3 scale is
// exact in BF16, so the products are those a block-scaled FP4 MMA forms; only the
// order of the FP32 sums differs). src/emulate/sage3 is the contract. The api layer
// validates and resolves defaults first.
#pragma once

#include "qattn/qattn.h"

namespace qattn::sage3 {

// Enqueues the quantization kernels and the attention kernel on `stream`; returns
// cudaSuccess or the first CUDA error; never synchronizes.
int launch_forward(const qattn_fwd_params& p, void* workspace, void* stream);

}  // namespace qattn::sage3
