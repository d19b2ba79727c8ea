// Option enums shared by the CPU emulators of the SageAttention2 family and the
// FP8-per-tensor baseline. Each enum names one switch of the scheme; the defaults in
// the per-scheme option structs are the SageAttention2-8b kernel's choices.
#pragma once

#include "numerics/formats.h"
#include "numerics/quantize.h"

namespace qattn::emulate {

// Format of the quantized Q and K for Q·Kᵀ.
enum class QkFormat {
  Int8,  // scale = amax/127, values in [-127, 127] (SageAttention2-8b)
  Int4,  // scale = amax/7, values in [-7, 7] (SageAttention2-4b)
  Fp32,  // no quantization: a check of the tiling and the online softmax alone
  Fp16,  // Q (− q̄) and K − c rounded to IEEE half, exact products, FP32 accumulation:
         // a 16-bit Q·Kᵀ (with KSmoothing::None on FP16 inputs: the caller's values)
  Bf16,  // the same in bfloat16
};

// Scale groups of Q and K (and of V) are numerics::Granularity (numerics/quantize.h):
// Q·Kᵀ takes PerTensor, PerBlock, PerWarp, PerThread or PerToken (SageAttention2 §3.2;
// the per-thread groups follow the wgmma fragment layout of numerics/mma_groups.h);
// V takes PerChannel (the kernel's: amax over all tokens), PerTileChannel (per 128-token
// tile and channel), PerBlock (one scale per 128-token tile) or PerTensor (per head).
using numerics::Granularity;

// The vector c subtracted from every key of a (batch, KV head) before quantization.
// Softmax is unchanged by any c; the LSE is corrected by sm_scale·q·c.
enum class KSmoothing {
  None,
  Mean,         // mean over all Nkv tokens (summed in double, stored as FP32)
  SampledMean,  // the kernel's: all tokens when Nkv <= 256, else tokens floor(i·Nkv/256)
  Given,        // a caller-given vector (the kernel's c, to compare bit for bit)
};

// An orthogonal rotation R of Q (after its smoothing) and of K − c along the head dim,
// before they are quantized: (qR)·(kR) = q·k in exact arithmetic, so only the rounding
// changes. R spreads a row's energy over its channels, so a single large element (a
// heavy tail, an outlier channel) no longer sets the step of the whole row's group.
// It is FlashAttention-3's "incoherent processing" for FP8 Q and K and QuaRot's
// rotation; SageAttention2 (Table 17) measured it *instead of* smoothing for INT4 and
// found it no better than no smoothing; here it is applied on top of the smoothing.
enum class QkRotation {
  None,      // the kernel's
  Hadamard,  // R = diag(s)·H/√D: H the Walsh–Hadamard matrix of order D (the padded head
             // dim, a power of two), s_c = ±1 a fixed pattern (hadamard_sign)
};

// Q smoothing per 64-row Q block: S = (Q - q̄)Kᵀ + q̄Kᵀ with q̄Kᵀ computed in high
// precision and added to the scores before softmax.
enum class QSmoothing { None, BlockMean };

// The amax behind V's PerChannel scales.
enum class VAmax {
  AllTokens,    // the amax over all Nkv tokens (a pass over V before quantizing it)
  SampleBound,  // the kernel's: numerics::sampled_amax_bound (4 × the amax of the K-mean
                // token sample, or the amax over all tokens where that is larger); E4M3
                // and E5M2 V only (INT8 V, fixed point, keeps AllTokens)
};

// Format of P̃ and V in the P·V product.
enum class PvFormat {
  E4M3,  // P̃·448 cast to E4M3; V per channel E4M3 with scale amax/448 (the kernel)
  E5M2,  // P̃·57344 cast to E5M2; V E5M2 with scale amax/57344
  Int8,  // P̃·127 rounded to [0, 127]; V INT8 with scale amax/127 (exact INT32 MMA)
  Fp16,  // P̃ and V rounded to IEEE half (no scales), FP32 accumulation
  Bf16,  // P̃ and V rounded to bfloat16 (no scales), FP32 accumulation
  Fp32,  // no rounding: a check of the tiling and the online softmax alone
};

// The accumulator of the FP8 MMA (E4M3/E5M2 products only; INT8 and 16-bit MMAs
// accumulate exactly in INT32 / FP32).
enum class Fp8Accumulator {
  Fp32,  // an ideal FP32 accumulator
  Fp22,  // Hopper/Ada's: after each k32 step the FP32 result keeps 13 fraction bits
         // (the low 10 are truncated; SageAttention2 §3.4)
};

// How each KV tile's P·V product reaches the output.
enum class AccumulationLevels {
  TwoLevel,  // a fresh accumulator per tile, added to the FP32 O after the rescale
  Single,    // accumulated straight into O (the FlashAttention-3 FP8 style)
};

// Where the softmax denominator l comes from.
enum class RowSum {
  FloatP,      // the sum of the FP32 P̃ values before their cast
  QuantizedP,  // the sum of the cast P values, accumulated like one more V channel of
               // ones in the tile's MMA (the Hopper kernel's: the ones ride along in the
               // P·V wgmma, so numerator and denominator use the same P)
};

// log2 of the factor P̃ is multiplied by before its cast, folded into the exponent
// (docs/sage2-kernel-arithmetic.md step 6). E4M3's is the kernel's (numerics/formats.h),
// so both use the very same float; the others exist only in the emulator.
using numerics::kLog2E4M3Max;
inline constexpr float kLog2E5M2Max = 15.807354922057604f;  // log2(57344) = log2(448) + 7
inline constexpr float kLog2Int8Max = 6.988684686772166f;   // log2(127)

}  // namespace qattn::emulate
