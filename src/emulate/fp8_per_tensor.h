// The FP8-per-tensor baseline (the FlashAttention-3 FP8 style) on the CPU.
//
// Q, K and V are each cast to E4M3 with one scale for the whole tensor (amax/448 over
// every batch, head, token and channel), with no smoothing. Q·Kᵀ runs on the FP8 MMA
// (k32 steps over the head dim, FP32 or FP22 accumulator), the scores are
// dequantized with s_q·s_k·sm_scale·log2(e), and the online softmax, the E4M3 cast of
// P̃·448 and the tiling (64-row Q blocks, 128-token KV tiles) are those of the
// SageAttention2 emulator (docs/sage2-kernel-arithmetic.md steps 5-8). P·V is
// accumulated straight into O by default (AccumulationLevels::Single, as
// FlashAttention-3's FP8 path does: no per-tile accumulator), so with the FP22
// accumulator its truncation compounds over the tiles; s_v and 1/l are applied at the
// end.
#pragma once

#include "emulate/options.h"
#include "emulate/sage2.h"
#include "reference/tensor.h"

namespace qattn::emulate {

struct Fp8PerTensorOptions {
  Fp8Accumulator accumulator = Fp8Accumulator::Fp22;
  AccumulationLevels levels = AccumulationLevels::Single;
};

// Throws std::invalid_argument naming the parameter on bad shapes or options.
EmulatedForward fp8_per_tensor_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                         const AttentionParams& params,
                                         const Fp8PerTensorOptions& options = {});

}  // namespace qattn::emulate
