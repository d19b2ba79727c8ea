// SageAttention2 on the CPU, step by step as the Hopper kernel computes it.
//
// With the default options (INT8 per-thread Q·Kᵀ, sampled-mean K smoothing, E4M3 P·V
// with per-channel V scales, two-level accumulation) this follows
// docs/sage2-kernel-arithmetic.md exactly: the quantized tensors equal the kernel's
// workspace bit for bit (given the kernel's smoothing vector c), and the output equals
// the kernel's to rounding (the kernel's ex2.approx against std::exp2). The other
// options are the paper's ablations (INT4, coarser groups, E5M2/INT8/16-bit P·V,
// Q smoothing, a global V scale) and are emulated with the same tiling.
//
// Tiling: Q blocks of 64 rows (groups::kQBlock), KV tiles of 128 tokens
// (groups::kKvTile), online softmax per row in the log2 domain with sm_scale·log2(e)
// folded into the Q scale. All arithmetic is FP32 unless stated.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "emulate/options.h"
#include "numerics/key_range.h"
#include "numerics/mma_groups.h"
#include "reference/tensor.h"
#include "reference/varlen.h"

namespace qattn::emulate {

// The truncation interval of sage2_wide_options() (see Sage2Options::fp22_keys), which
// there applies to O's channels only (the row sums are FP32 sums of P: RowSum::FloatP).
// A k32 step: the head-dim-256 kernel's O at 16K keys matched this model's CosSim and
// not the one-product model's (bench/NOTES.md v48); the all-positive ones columns that
// once carried the row sums fell like one truncation per product (v44b).
inline constexpr int kWideFp22Keys = 32;

struct Sage2Options {
  QkFormat qk_format = QkFormat::Int8;
  Granularity granularity = Granularity::PerThread;  // of Q and K
  KSmoothing k_smoothing = KSmoothing::SampledMean;
  std::vector<float> k_mean;  // (B, Hkv, d) when k_smoothing == Given
  QSmoothing q_smoothing = QSmoothing::None;
  QkRotation qk_rotation = QkRotation::None;  // applied after the smoothing
  PvFormat pv_format = PvFormat::E4M3;
  // V's format when it should differ from P's (an ablation that isolates P's format;
  // no MMA mixes formats, and the FP22 model follows P's format). Empty: pv_format.
  std::optional<PvFormat> v_format;
  // The kernel's: one scale per channel over all tokens. PerTileChannel (one per KV
  // tile and channel, no global pass over V) is the ablation of bench/NOTES.md v1.
  Granularity v_scale = Granularity::PerChannel;
  // With PerChannel: the kernel's amax is a bound from a token sample (bench/NOTES.md
  // v17a); AllTokens is the exact amax (the kernel's before v17a).
  VAmax v_amax = VAmax::SampleBound;
  // Defaults to the hardware's FP22 model: the emulator mirrors what the GPU computes.
  Fp8Accumulator accumulator = Fp8Accumulator::Fp22;
  // The kernel's: row sums of the cast P from a ones column in the P·V MMA
  // (docs/sage2-kernel-arithmetic.md step 7; bench/NOTES.md v15c). FloatP (FP32 sums of
  // P before the cast, the kernel's before v15c) is the ablation here and the
  // head-dim-256 kernel's choice (one level: bench/NOTES.md v48).
  RowSum row_sum = RowSum::QuantizedP;
  // The kernel's: a fresh accumulator per KV tile (SageAttention2's two-level
  // accumulation). Single (every tile's P·V straight into O, as FlashAttention-3's FP8
  // kernel does) is the ablation a kernel with no registers for a second accumulator
  // would run (bench/NOTES.md v38).
  AccumulationLevels levels = AccumulationLevels::TwoLevel;
  // Keys per online-softmax step (the kernel's KV tile): 128 (the d <= 128 kernel), or 64
  // (the head-dim-256 kernel). A divisor of 128 that is a multiple of fp22_keys.
  int softmax_keys = groups::kKvTile;
  // Products the FP8 MMA's accumulator takes between two FP22 truncations (a divisor of
  // 32): 32, one truncation per k32 step, is SageAttention2's model; the one-level
  // head-dim-256 kernel's LSE measured like a truncation after every one or two products
  // (bench/NOTES.md v44b).
  int fp22_keys = 32;
  // The head dim the workspace pads to: 0 for sage2_padded_head_dim(d); the head-dim-256
  // kernel pads 129..256 to 256.
  int head_dim_padded = 0;
};

// The contract of the head-dim-256 kernel (sage2_wide_sm90, docs/sage2-wide-kernel.md):
// the defaults with 64-key softmax steps, one-level accumulation (O rescaled in FP32 and
// accumulated through the FP22 model, a truncation after every `fp22_keys` products), the
// row sums summed in FP32 from P before its cast (RowSum::FloatP), and the head dim
// padded to 256.
Sage2Options sage2_wide_options(int fp22_keys = kWideFp22Keys);

// The quantized tensors, in the workspace layout of src/cuda/sage2_fwd/launch.h:
// D = head dim padded to 64 or 128 (to a multiple of 64 above 128, which no kernel
// takes), Dv the same of V's head dim (d_v, which may differ from Q·K's d: O is then
// (B, Hq, Nq, d_v)), Nq_pad and Nkv_pad = lengths rounded up to multiples of 128. Padding (tail
// rows/tokens, channels >= d) holds zeros and enters no amax; a group with no valid
// element, or whose values are all zero, has scale 0.
struct Sage2Quantized {
  int batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_kv = 0, head_dim = 0;
  int head_dim_padded = 0, nq_pad = 0, nkv_pad = 0;
  int head_dim_v = 0, head_dim_v_padded = 0;  // V's d_v and Dv (equal to d, D unless given)
  float sm_scale = 0.0f;
  float scale_log2 = 0.0f;  // sm_scale * log2(e), FP32
  Mask mask = Mask::None;
  // The masks beyond causal (reference/tensor.h AttentionParams; numerics/key_range.h).
  Diagonal alignment = Diagonal::BottomRight;
  int window_left = -1, window_right = -1;
  std::vector<int> kv_lengths;  // per batch entry; empty: every key
  // SDPA's attn_mask as additive values (reference/tensor.h AttentionParams), added to
  // the scores in log2 units as mask·log2(e) in FP32 after the scale; empty: none.
  Tensor4 attn_mask;
  Sage2Options options;

  // ---- the kernel workspace (INT8/INT4 Q·Kᵀ; INT4 values are stored in int8) -------
  std::vector<std::int8_t> q_i8;    // (B, Hq, Nq_pad, D)
  std::vector<float> q_scale;       // (B, Hq, Nq_pad/64*32), scale_log2 folded in; slot
                                    // blk*32 + groups::q_thread_group_in_block(r); coarser
                                    // groups replicated; empty for PerToken (no slot per row)
  std::vector<float> q_dot_c;       // (B, Hq, Nq_pad): sm_scale · q·c (FP32), tails 0
  std::vector<std::int8_t> k_i8;    // (B, Hkv, Nkv_pad, D), smoothed
  std::vector<float> k_scale;       // (B, Hkv, Nkv_pad/128*4), slot tile*4 +
                                    // groups::k_thread_group_in_tile(c); empty for PerToken
  std::vector<float> k_mean;        // (B, Hkv, D): c (zeros for KSmoothing::None)
  std::vector<std::uint8_t> vt_f8;  // (B, Hkv, Dv, Nkv_pad): Vᵀ codes (E4M3/E5M2 codes,
                                    // INT8 two's complement), position k of each 16 holds
                                    // token groups::v_token_at_position(k); empty for
                                    // 16-bit and FP32 P·V
  std::vector<float> v_scale;       // (B, Hkv, Nkv_pad/128, Dv); 1 for 16-bit/FP32 P·V

  // ---- what the emulator computes from (not in the workspace) ----------------------
  std::vector<float> q_row_scale;    // (B, Hq, Nq_pad): each row's Q scale (log2 folded)
  std::vector<float> k_token_scale;  // (B, Hkv, Nkv_pad): each token's K scale
  std::vector<float> q_f32;          // (B, Hq, Nq_pad, D) float Q·Kᵀ formats only (Fp32,
                                     // Fp16, Bf16): Q (- q̄), in that format
  std::vector<float> k_f32;          // (B, Hkv, Nkv_pad, D) float formats only: K - c
  std::vector<float> v_value;        // (B, Hkv, Nkv_pad, Dv): decoded V before v_scale,
                                     // token order
  std::vector<float> q_mean;         // (B, Hq, Nq_pad/64, D) QSmoothing::BlockMean: q̄
  std::vector<float> q_mean_k;       // (B, Hq, Nq_pad/64, Nkv_pad) BlockMean only:
                                     // scale_log2 · q̄·(k_j - c), added to the scores

  // Keys of batch entry b that enter the quantization (key padding; all without it).
  int keys_of(int b) const;
  // Which keys each query row of batch entry b sees.
  numerics::KeyRule key_rule(int b) const;

  std::size_t q_blocks() const { return static_cast<std::size_t>(nq_pad) / groups::kQBlock; }
  std::size_t kv_tiles() const { return static_cast<std::size_t>(nkv_pad) / groups::kKvTile; }
};

// Output of an emulated forward: O (B, Hq, Nq, d) and the natural-log LSE (B, Hq, Nq),
// corrected for K smoothing (fully masked rows: O = 0, LSE = -inf).
struct EmulatedForward {
  Tensor4 o;
  std::vector<float> lse;
};

// Head dim padded as the kernel's workspace pads it.
int sage2_padded_head_dim(int d);

// Steps 1-4 of the contract: smoothing vector, K, Q (and q·c), V. Throws
// std::invalid_argument naming the parameter on bad shapes or options.
Sage2Quantized quantize_sage2(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                              const AttentionParams& params, const Sage2Options& options = {});

// The SageAttention2-8b kernel's quantization with default options; a non-null
// `given_k_mean` ((B, Hkv, d) floats, e.g. read back from the kernel's workspace) replaces
// the sampled mean.
Sage2Quantized quantize_sage2_8b(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                 const AttentionParams& params,
                                 const float* given_k_mean = nullptr);

// Recomputes the emulator's views (q_row_scale, k_token_scale, v_value) from the
// workspace arrays (q_scale, k_scale, vt_f8), e.g. after a GPU test has copied a
// kernel's workspace into them: then sage2_attend runs on exactly the kernel's
// quantized tensors. Needs INT8/INT4 Q·Kᵀ with a kernel granularity (not PerToken)
// and an 8-bit V format; throws std::invalid_argument otherwise.
void sage2_views_from_workspace(Sage2Quantized& qz);

// Steps 5-8 on already quantized tensors (e.g. a kernel's workspace copied into `qz`,
// followed by sage2_views_from_workspace).
EmulatedForward sage2_attend(const Sage2Quantized& qz);

// quantize_sage2 followed by sage2_attend.
EmulatedForward sage2_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                const AttentionParams& params, const Sage2Options& options = {});

// ---- packed variable-length batches (reference/varlen.h) ---------------------------
//
// The contract of a varlen kernel: each sequence is quantized and attended alone, as the
// batch-1 call of quantize_sage2 / sage2_attend with Nq = len_q(b), Nkv = len_k(b) and
// the call's mask rule (causal and the window aligned per sequence). So the K smoothing
// mean is over one sequence's keys (its 256-token sample when it has more), and no
// scale group, Q block, KV tile or V amax reaches into another sequence. A kernel's
// workspace for sequence b holds exactly quantize_sage2_varlen(...)[b]'s tensors.

// O (total_q, Hq, d) and the natural-log LSE (Hq, total_q), FlashAttention's varlen
// layout; rows of a sequence without keys have O = 0 and LSE = -inf.
struct EmulatedVarlenForward {
  PackedTensor o;
  std::vector<float> lse;
};

// Per sequence b its quantized tensors (a batch of one); a sequence with len_q(b) = 0 or
// len_k(b) = 0 has nothing to quantize and gets an empty entry (batch = 0). With
// KSmoothing::Given, options.k_mean holds (batch, Hkv, d) vectors, one set per sequence.
// Throws std::invalid_argument as validate_varlen_args and quantize_sage2 do.
std::vector<Sage2Quantized> quantize_sage2_varlen(const PackedTensor& q, const PackedTensor& k,
                                                  const PackedTensor& v,
                                                  const VarlenLayout& layout,
                                                  const AttentionParams& params,
                                                  const Sage2Options& options = {});

// quantize_sage2_varlen, then sage2_attend per sequence, packed back.
EmulatedVarlenForward sage2_varlen_attention(const PackedTensor& q, const PackedTensor& k,
                                             const PackedTensor& v, const VarlenLayout& layout,
                                             const AttentionParams& params,
                                             const Sage2Options& options = {});

}  // namespace qattn::emulate
