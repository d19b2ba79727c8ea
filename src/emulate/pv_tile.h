// Internal: the per-row online softmax and the P·V product of one KV tile, shared by
// the emulators of the SageAttention2 family and the FP8-per-tensor baseline
// (docs/sage2-kernel-arithmetic.md, steps 6-8). Not a public header.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "emulate/common.h"
#include "emulate/options.h"
#include "numerics/formats.h"

namespace qattn::emulate::detail {

using emulate::kLn2;
using emulate::kLog2e;
using emulate::kNegInf;
// Tokens per k-step of an 8-bit wgmma (m64nNk32): the unit after which the FP8
// accumulator is modelled as truncated.
inline constexpr int kMmaK8bit = 32;
// FP32 has 23 fraction bits, the FP8 MMA accumulator keeps 13 (SageAttention2 §3.4).
inline constexpr int kFp22DroppedBits = 23 - 13;

// Drops the 10 low fraction bits (truncation toward zero), as the paper observed for
// mma.f32.f8.f8.f32: "the value of C is equal to D with its least significant 10
// mantissa bits zeroed out". Inf and NaN pass (a quiet NaN keeps its top bit).
inline float truncate_to_fp22(float x) {
  constexpr std::uint32_t kMask = ~((1u << kFp22DroppedBits) - 1u);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) & kMask);
}

// How P is formed and multiplied by V for one PV format.
struct PvSpec {
  float p_mult;       // P̃ is scaled to [0, p_mult] before the cast (448 for E4M3)
  float log2_p_mult;  // folded into the exponent: p = exp2(x - m + log2_p_mult)
  bool fp8_mma;       // the product runs on the FP8 MMA (FP22 accumulator applies)
  float (*round_p)(float);
};

inline float identity(float x) { return x; }
inline float int8_round_p(float x) { return numerics::int8_quantize(x, 1.0f); }

inline PvSpec pv_spec(PvFormat f) {
  switch (f) {
    case PvFormat::E4M3:
      return {numerics::kE4M3Max, kLog2E4M3Max, true, numerics::e4m3_round};
    case PvFormat::E5M2:
      return {numerics::kE5M2Max, kLog2E5M2Max, true, numerics::e5m2_round};
    case PvFormat::Int8:
      return {static_cast<float>(numerics::kInt8Max), kLog2Int8Max, false, int8_round_p};
    case PvFormat::Fp16:
      return {1.0f, 0.0f, false, numerics::fp16_round};
    case PvFormat::Bf16:
      return {1.0f, 0.0f, false, numerics::bf16_round};
    case PvFormat::Fp32:
      break;
  }
  return {1.0f, 0.0f, false, identity};
}

// Running state of one query row (log2 domain).
struct RowState {
  float m = kNegInf;
  float l = 0.0f;
  std::vector<float> o;  // FP32 output accumulator, D channels
  std::vector<double> step;
  std::vector<float> tile;  // per-tile accumulator (two-level accumulation)
  explicit RowState(int dim) : o(dim, 0.0f), step(dim), tile(dim) {}
};

// One KV tile of the online softmax for one row. `x` holds the tile's scores in log2
// units, -inf where masked; `v` is the tile's quantized V in token order (len x D,
// row-major, unscaled values); `v_scale` the per-channel scales applied to this tile's
// product (two-level) — with AccumulationLevels::Single the product goes straight
// into `o` and `v_scale` is ignored (the caller applies a per-tensor scale at the end).
// fp22_keys: products between two FP22 truncations (kMmaK8bit: one per k32 step). With
// AccumulationLevels::Single and RowSum::QuantizedP the row sum is one more channel of
// the accumulator: l rescaled by alpha, then the tile's products added through the
// same truncations (the hardware's ones columns).
inline void online_softmax_tile(RowState& st, std::vector<float>& x, const float* v, int len,
                                int dim, const float* v_scale, const PvSpec& spec,
                                Fp8Accumulator acc, AccumulationLevels levels,
                                RowSum row_sum = RowSum::FloatP, int fp22_keys = kMmaK8bit) {
  float mx = st.m;
  bool nan = std::isnan(st.m);
  for (int j = 0; j < len; ++j) {
    mx = std::fmax(mx, x[j]);
    nan = nan || std::isnan(x[j]);
  }
  // fmax drops NaN; a NaN score must reach O and the LSE (docs/design.md, Numerics), never 0.
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();
  const bool empty = mx == kNegInf;  // the row has seen only masked keys so far
  const float alpha = empty ? 1.0f : std::exp2(st.m - mx);
  float sum = 0.0f;
  for (int j = 0; j < len; ++j) {
    // No inf - inf when the row is still empty: every p is 0 then.
    const float p = empty ? 0.0f : std::exp2(x[j] - mx + spec.log2_p_mult);
    sum += p;
    x[j] = spec.round_p(p);
  }
  st.m = mx;
  if (row_sum == RowSum::FloatP) st.l = st.l * alpha + sum;

  const bool truncate = spec.fp8_mma && acc == Fp8Accumulator::Fp22;
  std::vector<float>& target = levels == AccumulationLevels::TwoLevel ? st.tile : st.o;
  if (levels == AccumulationLevels::TwoLevel) {
    std::fill(st.tile.begin(), st.tile.end(), 0.0f);
  } else {
    for (float& oc : st.o) oc *= alpha;
  }
  // Each step's fp22_keys products (32: a k32 step) are summed exactly (8-bit products
  // have <= 8 significant bits; double holds the sum exactly), then added to the FP32
  // accumulator, which the FP22 model truncates after every step.
  const bool single_sums = levels == AccumulationLevels::Single && row_sum == RowSum::QuantizedP;
  // The ones channel (RowSum::QuantizedP): from zero per tile, or (one level) from l·alpha.
  float tile_sum = single_sums ? st.l * alpha : 0.0f;
  for (int k0 = 0; k0 < len; k0 += fp22_keys) {
    std::fill(st.step.begin(), st.step.end(), 0.0);
    double step_sum = 0.0;
    const int k1 = std::min(len, k0 + fp22_keys);
    for (int j = k0; j < k1; ++j) {
      if (x[j] == 0.0f) continue;
      const double pj = x[j];
      step_sum += pj;
      const float* vj = v + static_cast<std::size_t>(j) * dim;
      for (int c = 0; c < dim; ++c) st.step[c] += pj * vj[c];
    }
    for (int c = 0; c < dim; ++c) {
      const float s = static_cast<float>(static_cast<double>(target[c]) + st.step[c]);
      target[c] = truncate ? truncate_to_fp22(s) : s;
    }
    const float s = static_cast<float>(static_cast<double>(tile_sum) + step_sum);
    tile_sum = truncate ? truncate_to_fp22(s) : s;
  }
  if (single_sums)
    st.l = tile_sum;
  else if (row_sum == RowSum::QuantizedP)
    st.l = st.l * alpha + tile_sum;
  if (levels == AccumulationLevels::TwoLevel) {
    for (int c = 0; c < dim; ++c) {
      const float scaled = st.tile[c] * v_scale[c];
      st.o[c] = st.o[c] * alpha + scaled;
    }
  }
}

}  // namespace qattn::emulate::detail
