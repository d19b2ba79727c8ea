// The precision guard (issue 22) on the CPU: per (batch, head), the SageAttention2-8b
// kernel's arithmetic ("fast") or a 16-bit one ("precise"), and "auto", which decides
// per head from statistics the fast path's quantization already has.
//
// Why a guard: INT8 Q·Kᵀ makes a *relative* error in the scores that is small, but
// the softmax feels the *absolute* error: exp(s + δs) = exp(s)·(1 + δs), so a score
// error of δs nats is a relative error δs in P̃. Large logits (a head whose q·k spans
// tens of nats) turn the small relative error into large absolute ones, and a head
// whose attention is nearly one-hot then weighs the wrong keys. FP8 P·V has an error
// floor of its own that no Q·Kᵀ fixes (V's E4M3 rounding, ~2.7% per element).
//
// The rule (docs/design.md, "Precision modes"; bench/NOTES.md, "Precision guard"):
// under the standard model of rounding (each code's error uniform in ±½ step and
// independent), the score error of a query row i and key j, in log2 units, has
//   σ_ij² = (a_i²·|k_j − c|² + b_j²·|q_i|²·scale_log2²) / 12,
// a_i = the row's Q step with sm_scale·log2(e) folded in (q_row_scale), b_j = the
// token's K step (k_token_scale). The guard takes each head's worst pair,
//   σ² = (max a_i² · max |k_j − c|² + max b_j² · max scale_log2²·|q_i|²) / 12,
// (max over the head's rows and tokens; per Q block × KV tile on a GPU, where these
// are per-group amax and per-row/token norms that the quantization pass reads anyway)
// and flags the head when σ (in nats) exceeds the RMS relative error of an E4M3 cast,
//   ε_E4M3 = 2^-4 / √(8 ln 2) ≈ 0.0265
// (3 fraction bits, values spread log-uniformly within a binade), the error that P̃'s
// own cast to E4M3 makes in every P̃: below it, INT8 Q·Kᵀ costs P̃ no more than the
// FP8 P·V that follows already does; above it, Q·Kᵀ dominates.
#pragma once

#include <cstdint>
#include <vector>

#include "emulate/sage2.h"

namespace qattn::emulate {

enum class Precision {
  Fast,     // every head: the SA2-8b kernel (INT8 Q·Kᵀ, FP8 E4M3 P·V)
  Auto,     // per head: Precise where precision_guard flags the head, Fast elsewhere
  Precise,  // every head: Q·Kᵀ and P·V in the input's 16-bit type (FP32 accumulation)
};

// The 16-bit type of the inputs, which "precise" computes in.
enum class InputDtype { Fp16, Bf16 };

const char* precision_name(Precision p);  // "fast", "auto", "precise"

// "fast": Sage2Options' defaults, the SA2-8b kernel's.
Sage2Options fast_options();
// "precise": Q·Kᵀ on the caller's 16-bit Q and K (no smoothing: nothing to quantize),
// P̃ and V in the same type, FP32 accumulation: FlashAttention's arithmetic in the
// SA2 kernel's tiling and online softmax.
Sage2Options precise_options(InputDtype dtype = InputDtype::Fp16);

// ε_E4M3 above: the guard's threshold on σ, in nats.
double guard_threshold_nats();

struct PrecisionGuard {
  double threshold_nats = 0.0;
  std::vector<double> sigma_nats;     // (B, Hq): σ of each head, nats
  std::vector<std::uint8_t> flagged;  // (B, Hq): 1 where σ > threshold_nats
  double flagged_fraction() const;
};

// The rule on the fast path's quantized tensors (INT8/INT4 Q·Kᵀ with per-row and
// per-token steps: q_row_scale, k_token_scale, q_i8, k_i8). Throws
// std::invalid_argument for a float Q·Kᵀ format.
PrecisionGuard precision_guard(const Sage2Quantized& fast);

struct PrecisionForward {
  EmulatedForward fwd;
  PrecisionGuard guard;               // computed in every mode (from the fast quantization)
  std::vector<std::uint8_t> precise;  // (B, Hq): 1 where the head ran "precise"
};

// The forward in one precision mode. Auto equals Precise bit for bit on the flagged
// heads and Fast on the others (each head's output and LSE are taken from the one
// scheme's emulation of the whole call; both schemes quantize per head).
PrecisionForward attention_with_precision(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                          const AttentionParams& params, Precision precision,
                                          InputDtype dtype = InputDtype::Fp16);

}  // namespace qattn::emulate
