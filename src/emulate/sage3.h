// SageAttention3 (microscaling FP4 attention) on the CPU, step by step.
//
// The steps follow Algorithm 1 of the SageAttention3 paper
// (papers/sageattention3-fp4-and-sagebwd.txt, "FP4 Attention Kernel Algorithm"),
// with the FlashAttention tiling of the other emulators (Q blocks of 64 rows,
// groups::kQBlock; KV tiles of 128 tokens, groups::kKvTile). FP32 unless stated.
//
//  1. Smooth K (§3.1 / Algorithm 1 line 2; SageAttention2 §3.1): c = per-channel mean
//     of K over tokens, K ← K − c. Softmax is unchanged; the LSE gains sm_scale·q·c.
//  2. Per Q block i (Algorithm 1 line 5): q̄_i = mean of the block's rows,
//     Q_i ← Q_i − q̄_i (QSmoothing::BlockMean), and φ(Q_i): FP4 microscaling along the
//     head dim — NVFP4 blocks of 16 with an E4M3 scale E4M3(amax/6), or MXFP4 blocks
//     of 32 with an E8M0 scale (§3.1, "NVFP4, not MXFP4").
//  3. φ(K_j) along the head dim and φ(V_j) along the tokens (the reduction dim of
//     P·V: per channel, blocks of 16 (32) consecutive tokens) (line 7).
//  4. S_ij = FP4MM(Q̂_i, K̂_j) + q̄_i·K_jᵀ (line 8). FP4MM: per scale block, the sum
//     of E2M1 products (exact in FP32) times s_q·s_k, accumulated over blocks in FP32
//     (what the block-scaled MMA computes). The GEMV q̄_i·K_jᵀ uses the unquantized
//     smoothed K in FP32 (the paper's "high-precision" correction).
//  5. Online softmax in the log2 domain (line 9): x = S·sm_scale·log2(e),
//     m_new = max(m, rowmax_j x), P̃ = exp2(x − m_new), l ← l·exp2(m − m_new) + ΣP̃.
//  6. Quantize P̃ along the tokens (line 10, §3.2 "two-level quantization"):
//       PScaling::TwoLevel: s_p1 = exp2(rowmax_j x − m_new)/(448·6) — rowmax(P̃)
//         taken from the softmax statistics, no pass over P̃ — P2 = P̃/s_p1, φ(P2);
//       PScaling::Direct:  φ(P̃), whose block scales E4M3(amax/6) lie in [0, 1/6].
//  7. O_ij = FP4MM(P̂, V̂) (same block-scaled sum as step 4) in a fresh FP32
//     accumulator, times s_p1 (two-level), then O ← O·exp2(m − m_new) + O_ij
//     (line 11; two-level accumulation of docs/design.md, Numerics).
//  8. O ← O / l; LSE = (m + log2 l)·ln 2 + sm_scale·q·c (line 13). A row that sees
//     no key gives O = 0 and LSE = −inf.
//
// Tail tokens of a KV tile beyond Nkv (and masked positions) have P̃ = 0; V's tail
// tokens are zero and enter no scale. The head dim must be a multiple of the FP4
// block (16 for NVFP4, 32 for MXFP4).
#pragma once

#include <limits>
#include <vector>

#include "emulate/options.h"
#include "emulate/sage2.h"
#include "numerics/quantize.h"
#include "reference/tensor.h"

namespace qattn::emulate {

// How P̃ is quantized for the FP4 P·V (SageAttention3 §3.2).
enum class PScaling {
  TwoLevel,  // per-row FP32 s_p1 = rowmax/(448·6) first, then FP4 of P̃/s_p1
  Direct,    // FP4 of P̃ itself
};

struct Sage3Options {
  numerics::Fp4Format format = numerics::Fp4Format::NvFp4;  // Q, K, P and V alike
  PScaling p_scaling = PScaling::TwoLevel;
  KSmoothing k_smoothing = KSmoothing::Mean;  // None, Mean or SampledMean
  QSmoothing q_smoothing = QSmoothing::BlockMean;
};

// Optional record of what the emulator fed to the P·V product: every dequantized P
// value (E2M1 × block scale, × s_p1 for two-level) of every visible (row, key) of the
// query rows below `row_limit` of each head (a bound on memory for long sequences).
struct Sage3PTrace {
  int row_limit = std::numeric_limits<int>::max();
  std::vector<float> p_dequantized;
};

// Throws std::invalid_argument naming the parameter on bad shapes or options.
EmulatedForward sage3_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const Sage3Options& options = {},
                                Sage3PTrace* trace = nullptr);

}  // namespace qattn::emulate
