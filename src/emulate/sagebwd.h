// SageBwd (INT8 trainable attention, SageAttention3 paper §4) on the CPU, step by step.
//
// Tiling: Q blocks of 64 rows (groups::kQBlock), KV tiles of 128 tokens
// (groups::kKvTile); "per-block" below means one scale per Q block (64 × d), per KV
// tile (128 × d), or per (Q block × KV tile) tile of P / dS. Scales are amax/127 for
// INT8 and amax/448 for E4M3 (Bwd8Format::E4M3, the paper's "FP8 SageBwd" of §5.4).
// Products of 8-bit values are summed exactly (INT32 on the GPU; double here) and the
// scale product applied once per tile. FP32 elsewhere.
//
// Forward (paper Algorithm 2):
//  1. Smooth K (line 2): K ← K − mean(K); the LSE gets sm_scale·q·c back at the end.
//  2. ψ(Q_i), ψ(K_j), ψ(V_j): per-block 8-bit (§4.1, "per-block INT8 quantizer").
//  3. S_ij = ψ⁻¹(Q̂_i K̂_jᵀ); online softmax in the log2 domain, as in sage3.h step 5.
//  4. P per token (§4.1, Algorithm 2 line 10): s_P = exp(rowmax(S_ij) − m_ij)/127 —
//     the row maximum of P̃ from the softmax statistics — P̂ = round(P̃/s_P).
//  5. O ← O·exp2(m − m_new) + s_P·s_V·(P̂ V̂) (fresh accumulator per tile); at the end
//     O /= l and LSE = (m + log2 l)·ln 2 + sm_scale·q·c (natural log, saved).
//
// Backward (paper Algorithm 3, the FlashAttention-2 order: KV tile j outer, Q block i
// inner), given O, LSE and dO:
//  0. D_i = rowsum(dO_i ∘ O_i) (FP32).
//  1. Recompute S_ij from the same ψ(Q_i), ψ(K_j); P_ij = exp2(x − LSE_smoothed·log2 e).
//  2. dV_j += ψ(P_ij)ᵀ ψ(dO_i) (lines 5-7; per-block P and dO).
//  3. dP_ij = dO_i V_jᵀ (line 8): DoVFormat::Fp16 — both operands rounded to FP16,
//     exact products, FP32 sum (the paper's choice, §4.2) — or DoVFormat::Quantized,
//     ψ(dO_i) ψ(V_j)ᵀ in the 8-bit format (the ablation of Table 1(c)).
//  4. dS_ij = P_ij ∘ (dP_ij − D_i) (line 9, FP32), then ψ(dS_ij) per tile.
//  5. dQ_i += sm_scale·ψ(dS_ij) ψ(K_j) with the smoothed K (line 10). dS·K =
//     dS·(K − c) + (dS·1)c, and dS·1 = rowsum(P ∘ (dP − D)) = dO·O − D = 0 exactly, so
//     the second term carries only the error of D (from the quantized forward's O),
//     amplified by |c|; qattn leaves it out (the GPU kernel's contract). Measured on the
//     report's generator (1K, d=128, 5 seeds, bench/results/sagebwd-forward-choice.txt):
//     dQ CosSim 0.9955 -> 0.9979 with the SA2 forward, higher with the per-token forward
//     too. SageBwdOptions::dq_mean_term = true keeps it, as the paper's Algorithm 3 does
//     (the accuracy report's paper rows).
//  6. dK_j += sm_scale·ψ(dS_ij)ᵀ ψ(Q_i) (line 11).
// dK and dV of a KV head are summed over the query heads that share it (GQA).
//
// Bwd8Scales::MergeFree (E4M3 only; bench/NOTES.md v87): scales that never change from
// one Q block to the next, so a kernel's accumulators need no merge. The scores (step 1)
// are as above; then, per (batch, KV head) and the query heads of its group:
//  a. P's row maximum Pmax_i = exp2(m_i − lse2_i), m_i the row's largest score (log2
//     units) over every visible key: SageBwdOptions::p_max where given (what the GPU
//     forward wrote, qattn_fwd_params.p_max), else from the scores above; and V's
//     per-channel maximum |V|_c over the KV head's tokens (FP16).
//  b. s_i = Pmax_i·(Σ_c |dO_ic|·|V|_c + |D_i|) / 448 (dO in FP16): a bound of row i's
//     largest |dS| (|dS_ij| = P_ij·|dP_ij − D_i|), fixed before any tile.
//  c. dV_j = Σ_h (s_dO,c / 448) · Σ_i E4M3(P_ij·448) · E4M3(dO_ic / s_dO,c), s_dO,c = the
//     channel's amax over every row of the group's query heads / 448: one exact sum over
//     every Q block of a head.
//  d. dŜ_ij = E4M3(dS_ij / s_i) (saturating); dQ_i += sm_scale·s_i·s_K(tile)·Σ_j dŜ_ij·K̂_j
//     with step 1's K̂; dK_j = Σ_h sm_scale·s_Q',c · Σ_i dŜ_ij·E4M3(s_i·Q_ic / s_Q',c),
//     s_Q',c = amax |s_i·Q_ic| over the group's rows / 448. One scale per channel for the
//     whole group, so a kernel sums every head of the group in one accumulator.
// dO·Vᵀ is the FP16 product (dov = Quantized is refused); pds_block_keys does not apply;
// dq_mean_term does (the same FP32 term).
#pragma once

#include <span>
#include <vector>

#include "emulate/options.h"
#include "emulate/sage2.h"
#include "reference/tensor.h"

namespace qattn::emulate {

// The 8-bit format of SageBwd's quantized matmuls.
enum class Bwd8Format {
  Int8,  // scale amax/127, values in [-127, 127] (SageBwd)
  E4M3,  // scale amax/448, values E4M3 (the paper's FP8 comparison, §5.4)
};

// Precision of dP = dO·Vᵀ in the backward.
enum class DoVFormat {
  Fp16,       // FP16 operands, FP32 accumulation (SageBwd: §4.2)
  Quantized,  // the same 8-bit per-block format as the other matmuls (ablation)
};

// Scales of the backward's 8-bit products.
enum class Bwd8Scales {
  PerBlock,   // per Q block, KV tile and (Q block × keys) tile (SageBwd; above)
  MergeFree,  // fixed before the kernel (the MergeFree steps above); format E4M3 only
};
struct SageBwdOptions {
  Bwd8Format format = Bwd8Format::Int8;
  Bwd8Scales scales = Bwd8Scales::PerBlock;
  DoVFormat dov = DoVFormat::Fp16;
  // None, Mean or SampledMean. SampledMean (the GPU backward's) smooths K with the mean
  // of the training forward's token sample, so the backward's scores are smoothed as the
  // forward's were (bench/NOTES.md v23c, v42: the full mean costs peaked attention
  // ~1e-3 of every gradient's CosSim).
  KSmoothing k_smoothing = KSmoothing::SampledMean;
  bool dq_mean_term = false;  // add sm_scale·rowsum(dS)·c to dQ (paper; step 5 above)
  // Keys per scale of ψ(P) and ψ(dS) in steps 2 and 4: 64, one scale per half of the KV
  // tile (a warpgroup's KV rows: the GPU kernel's contract, tile.cuh TileFrags, and closer
  // to FP64: bench/NOTES.md v58), or 128, the whole tile (the paper's per-block scales);
  // with 64, dQ sums the halves with their own scales.
  int pds_block_keys = 64;
  // MergeFree only: P's row maxima from the forward, (B, Hq, Nq) in lse's order (the
  // GPU forward's qattn_fwd_params.p_max); empty: recomputed from the scores (step a).
  std::span<const float> p_max;
};

struct EmulatedGrads {
  Tensor4 dq;  // (B, Hq, Nq, d)
  Tensor4 dk;  // (B, Hkv, Nkv, d)
  Tensor4 dv;  // (B, Hkv, Nkv, d)
};

// Throws std::invalid_argument naming the parameter on bad shapes or options.
EmulatedForward sagebwd_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const SageBwdOptions& options = {});

// Gradients of sum(O ∘ dO); `o` and `lse` are what sagebwd_forward returned for the
// same inputs and options. Throws std::invalid_argument on bad shapes.
EmulatedGrads sagebwd_backward(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                               const Tensor4& o, const std::vector<float>& lse, const Tensor4& dout,
                               const AttentionParams& params, const SageBwdOptions& options = {});

}  // namespace qattn::emulate
