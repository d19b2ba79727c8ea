#include "emulate/fp8_per_tensor.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "emulate/pv_tile.h"
#include "numerics/formats.h"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"
#include "numerics/quantize.h"

// NOTE: FP32 steps must not be contracted into FMAs (see sage2.cpp).
#pragma GCC optimize("fp-contract=off")

namespace qattn::emulate {
namespace {

using detail::kNegInf;
constexpr int kKvTile = groups::kKvTile;

// The whole tensor as E4M3 with one scale: decoded codes (unscaled) and the scale.
struct PerTensorFp8 {
  std::vector<float> values;
  float scale = 0.0f;
};

PerTensorFp8 cast_per_tensor(const Tensor4& t) {
  numerics::Fp8Quantized fq = numerics::quantize_fp8(t.data, static_cast<int64_t>(t.b) * t.h * t.n,
                                                     t.d, numerics::Fp8Format::E4M3,
                                                     Granularity::PerTensor, numerics::Operand::K);
  PerTensorFp8 r;
  r.scale = fq.scales.at(0);
  r.values.resize(fq.codes.size());
  for (std::size_t i = 0; i < fq.codes.size(); ++i)
    r.values[i] = numerics::e4m3_decode(fq.codes[i]);
  return r;
}

// One score: the FP8 MMA's dot over the head dim in k32 steps (each step exact in
// double, then added to the FP32 / FP22 accumulator).
float fp8_dot(const float* a, const float* b, int d, bool truncate) {
  float acc = 0.0f;
  for (int c0 = 0; c0 < d; c0 += detail::kMmaK8bit) {
    double step = 0.0;
    const int c1 = std::min(d, c0 + detail::kMmaK8bit);
    for (int c = c0; c < c1; ++c) step += static_cast<double>(a[c]) * b[c];
    const float s = static_cast<float>(static_cast<double>(acc) + step);
    acc = truncate ? detail::truncate_to_fp22(s) : s;
  }
  return acc;
}

}  // namespace

EmulatedForward fp8_per_tensor_attention(const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                         const AttentionParams& params,
                                         const Fp8PerTensorOptions& options) {
  const double sm = validate_attention_args("fp8_per_tensor_attention", q, k, v, params);
  require_equal_head_dims("fp8_per_tensor_attention", q, v);
  require_plain_mask("fp8_per_tensor_attention", params);
  if (options.accumulator != Fp8Accumulator::Fp32 && options.accumulator != Fp8Accumulator::Fp22) {
    throw std::invalid_argument(
        "fp8_per_tensor_attention: options.accumulator: expected Fp32 or Fp22");
  }
  if (options.levels != AccumulationLevels::TwoLevel &&
      options.levels != AccumulationLevels::Single) {
    throw std::invalid_argument(
        "fp8_per_tensor_attention: options.levels: expected TwoLevel or Single");
  }
  const int B = q.b, Hq = q.h, Hkv = k.h, Nq = q.n, Nkv = k.n, d = q.d, rep = Hq / Hkv;
  const PerTensorFp8 q8 = cast_per_tensor(q), k8 = cast_per_tensor(k), v8 = cast_per_tensor(v);
  const float scale_log2 = static_cast<float>(sm) * detail::kLog2e;
  const float qk_scale = q8.scale * k8.scale * scale_log2;
  const bool truncate = options.accumulator == Fp8Accumulator::Fp22;
  const detail::PvSpec spec = detail::pv_spec(PvFormat::E4M3);
  // The per-tensor V scale as a per-channel vector (two-level applies it per tile).
  const std::vector<float> v_scale(d, v8.scale);

  EmulatedForward out{Tensor4(B, Hq, Nq, d),
                      std::vector<float>(static_cast<std::size_t>(B) * Hq * Nq)};
  std::vector<float> x(kKvTile), vtile(static_cast<std::size_t>(kKvTile) * d);
  detail::RowState st(d);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / rep;
      for (int i = 0; i < Nq; ++i) {
        st.m = kNegInf;
        st.l = 0.0f;
        std::fill(st.o.begin(), st.o.end(), 0.0f);
        const float* qa = q8.values.data() + q.index(b, h, i, 0);
        const int last = scores::last_visible_key(Nq, Nkv, params.mask == Mask::Causal, i);
        for (int t = 0; t * kKvTile <= last; ++t) {
          std::fill(vtile.begin(), vtile.end(), 0.0f);
          for (int jj = 0; jj < kKvTile; ++jj) {
            const int j = t * kKvTile + jj;
            if (j > last) {
              x[jj] = kNegInf;
              continue;
            }
            x[jj] = fp8_dot(qa, k8.values.data() + k.index(b, hk, j, 0), d, truncate) * qk_scale;
            std::copy_n(v8.values.data() + v.index(b, hk, j, 0), d, vtile.data() + jj * d);
          }
          detail::online_softmax_tile(st, x, vtile.data(), kKvTile, d, v_scale.data(), spec,
                                      options.accumulator, options.levels);
        }
        float* orow = out.o.row(b, h, i);
        float& lse = out.lse[(static_cast<std::size_t>(b) * Hq + h) * Nq + i];
        if (st.m == kNegInf) {
          lse = kNegInf;
          continue;
        }
        const bool single = options.levels == AccumulationLevels::Single;
        for (int c = 0; c < d; ++c) orow[c] = (single ? st.o[c] * v8.scale : st.o[c]) / st.l;
        lse = (st.m + std::log2(st.l / spec.p_mult)) * detail::kLn2;
      }
    }
  return out;
}

}  // namespace qattn::emulate
