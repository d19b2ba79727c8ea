// The SageAttention3 emulator: against an untiled recomputation from the numerics
// layer's quantizers (tight), against the FP64 reference (format-level thresholds),
// the paper's orderings on fixed seeds, fresh random inputs, masks/GQA, bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "attention_test_util.h"
#include "emulate/sage3.h"
#include "emulate/synthetic.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace qattn {
namespace {

using emulate::PScaling;
using emulate::QSmoothing;
using emulate::sage3_attention;
using emulate::Sage3Options;
using emulate::SyntheticSpec;
using numerics::Fp4Format;

SyntheticSpec small_spec(std::uint64_t seed, double temperature = 1.0) {
  SyntheticSpec s;
  s.batch = 1;
  s.heads_q = 2;
  s.heads_kv = 2;
  s.seq_q = 256;
  s.seq_kv = 256;
  s.head_dim = 64;
  s.temperature = temperature;
  s.seed = seed;
  return s;
}

double cos_vs_reference(const emulate::SyntheticInputs& in, const Sage3Options& opt,
                        const AttentionParams& params = {}) {
  const auto ref = reference::attention_forward(in.q, in.k, in.v, params);
  const auto out = sage3_attention(in.q, in.k, in.v, params, opt);
  return metrics::compare(out.o.data, ref.o.data).cos_sim;
}

// ---- exactness of the steps ---------------------------------------------------------

// One KV tile (Nkv = 128), no Q smoothing: the emulator must equal an untiled
// recomputation built only from numerics::quantize_fp4 / quantize_p_two_level and
// double sums for P·V. The scores follow the header's FP32 order, so P is quantized
// from identical floats; the only difference left is the emulator's FP32 sum of
// 128 P·V terms and of l against double here: 2e-5 relative is ~100 FP32 ulps.
TEST(Sage3, MatchesUntiledRecomputationOnOneTile) {
  SyntheticSpec s = small_spec(7);
  s.heads_q = s.heads_kv = 1;
  s.seq_q = 64;
  s.seq_kv = 128;
  const auto in = emulate::make_synthetic(s);
  Sage3Options opt;
  opt.q_smoothing = QSmoothing::None;
  const auto out = sage3_attention(in.q, in.k, in.v, {}, opt);

  const int nq = s.seq_q, nkv = s.seq_kv, d = s.head_dim;
  const auto ks = numerics::smooth_k(in.k.data, nkv, d);
  const auto qz = numerics::quantize_fp4(in.q.data, nq, d, Fp4Format::NvFp4);
  const auto kz = numerics::quantize_fp4(ks.values, nkv, d, Fp4Format::NvFp4);
  std::vector<float> vt(static_cast<std::size_t>(d) * nkv);
  for (int j = 0; j < nkv; ++j)
    for (int c = 0; c < d; ++c) vt[c * nkv + j] = in.v.data[j * d + c];
  const auto vz = numerics::quantize_fp4(vt, d, nkv, Fp4Format::NvFp4);
  const float scale_log2 = static_cast<float>(1.0 / std::sqrt(double(d)) * 1.4426950408889634);

  std::vector<float> p(static_cast<std::size_t>(nq) * nkv), rowmax(nq);
  std::vector<double> l(nq, 0.0);
  for (int i = 0; i < nq; ++i) {
    std::vector<float> x(nkv);
    for (int j = 0; j < nkv; ++j) {
      // The documented FP32 order: exact block terms, summed over blocks in FP32.
      float acc = 0.0f;
      for (int blk = 0; blk < d / 16; ++blk) {
        float part = 0.0f;
        for (int c = blk * 16; c < blk * 16 + 16; ++c) {
          part += numerics::e2m1_decode(qz.codes[i * d + c]) *
                  numerics::e2m1_decode(kz.codes[j * d + c]);
        }
        acc += (qz.scales[i * (d / 16) + blk] * kz.scales[j * (d / 16) + blk]) * part;
      }
      x[j] = acc * scale_log2;
    }
    const float mx = *std::max_element(x.begin(), x.end());
    for (int j = 0; j < nkv; ++j) {
      p[i * nkv + j] = std::exp2(x[j] - mx);
      l[i] += p[i * nkv + j];
    }
    rowmax[i] = 1.0f;  // exp2(rowmax − m) with m = rowmax on the only tile
  }
  const auto pz = numerics::quantize_p_two_level(p, nq, nkv, rowmax);
  double worst = 0.0;
  for (int i = 0; i < nq; ++i) {
    for (int c = 0; c < d; ++c) {
      double acc = 0.0;
      for (int j = 0; j < nkv; ++j)
        acc += double(pz.dequantized[i * nkv + j]) * vz.dequantized[c * nkv + j];
      const double want = acc / l[i];
      worst = std::max(worst, std::fabs(want - out.o.data[i * d + c]) / (std::fabs(want) + 1e-3));
    }
  }
  EXPECT_LT(worst, 2e-5);
}

// K smoothing subtracts the mean, so a per-channel offset δ added to every key leaves
// the smoothed K — hence O — bit for bit the same, and moves the LSE by sm_scale·q·δ.
// The inputs are multiples of 1/8 and δ small integers, so every sum and the mean
// (over 256 = 2^8 tokens) are exact.
TEST(Sage3, KSmoothingMakesOutputInvariantToKeyOffset) {
  SyntheticSpec s = small_spec(11);
  s.heads_q = s.heads_kv = 1;
  auto in = emulate::make_synthetic(s);
  for (Tensor4* t : {&in.q, &in.k, &in.v}) {
    for (float& x : t->data) x = std::round(x * 8.0f) / 8.0f;
  }
  Tensor4 k2 = in.k;
  std::vector<float> delta(s.head_dim);
  for (int c = 0; c < s.head_dim; ++c) delta[c] = static_cast<float>((c % 7) - 3);
  for (int j = 0; j < s.seq_kv; ++j)
    for (int c = 0; c < s.head_dim; ++c) k2.at(0, 0, j, c) += delta[c];

  const auto a = sage3_attention(in.q, in.k, in.v, {});
  const auto b = sage3_attention(in.q, k2, in.v, {});
  EXPECT_EQ(a.o.data, b.o.data);
  const double sm = 1.0 / std::sqrt(double(s.head_dim));
  for (int i = 0; i < s.seq_q; ++i) {
    double qd = 0.0;
    for (int c = 0; c < s.head_dim; ++c) qd += double(in.q.at(0, 0, i, c)) * delta[c];
    EXPECT_NEAR(b.lse[i] - a.lse[i], sm * qd, 1e-4 * (1.0 + std::fabs(sm * qd)));
  }
}

// ---- against the FP64 reference -----------------------------------------------------

// NVFP4 with two-level P and Q+K smoothing on diffuse attention (T = 1). Threshold 0.97:
// E2M1 keeps one mantissa bit, so each quantized element has up to ~1/6 relative
// error (1/12 on average). The paper reports 99.52% on CogVideoX and an independent
// harness 98.1% on i.i.d. Gaussian 1024×128 inputs — the harshest case, near-uniform
// rows. 0.97 leaves room for seeds without admitting a broken step, which scores far
// below (a wrong P scale or a lost correction term drops CosSim under 0.9).
constexpr double kNvfp4CosMin = 0.97;

TEST(Sage3, DefaultIsCloseToReference) {
  const auto in = emulate::make_synthetic(small_spec(1));
  EXPECT_GT(cos_vs_reference(in, {}), kNvfp4CosMin);
}

TEST(Sage3, LseMatchesReference) {
  const auto in = emulate::make_synthetic(small_spec(2));
  const auto ref = reference::attention_forward(in.q, in.k, in.v, {});
  const auto out = sage3_attention(in.q, in.k, in.v, {});
  // The LSE sums unquantized P̃, so only the FP4 score error reaches it: here about
  // 0.1 logit units per score (E2M1's ~1/12 relative error averaged over d = 64
  // products), which moves log Σ exp(S) by its P-weighted mean plus half its variance:
  // measured rms 0.023, worst row 0.11. A lost K-smoothing correction (sm_scale·q·c,
  // of order 1 with this K bias) or a wrong log base would exceed both bounds.
  double worst = 0.0, sq = 0.0;
  for (std::size_t i = 0; i < ref.lse.size(); ++i) {
    const double e = out.lse[i] - ref.lse[i];
    worst = std::max(worst, std::fabs(e));
    sq += e * e;
  }
  EXPECT_LT(std::sqrt(sq / ref.lse.size()), 0.05);
  EXPECT_LT(worst, 0.25);
}

TEST(Sage3, CausalGqaAndShorterQueries) {
  SyntheticSpec s = small_spec(3);
  s.heads_q = 4;
  s.heads_kv = 2;
  s.seq_q = 200;  // not a multiple of the 64-row block, Nq != Nkv
  s.seq_kv = 300;
  const auto in = emulate::make_synthetic(s);
  AttentionParams p;
  p.mask = Mask::Causal;
  EXPECT_GT(cos_vs_reference(in, {}, p), kNvfp4CosMin);
}

TEST(Sage3, RowsThatSeeNoKeyGiveZeroAndMinusInfinity) {
  SyntheticSpec s = small_spec(4);
  s.heads_q = s.heads_kv = 1;
  s.seq_q = 160;  // causal, bottom-right: rows i < 160 − 96 see no key
  s.seq_kv = 96;
  const auto in = emulate::make_synthetic(s);
  AttentionParams p;
  p.mask = Mask::Causal;
  const auto out = sage3_attention(in.q, in.k, in.v, p);
  for (int i = 0; i < s.seq_q - s.seq_kv; ++i) {
    EXPECT_EQ(out.lse[i], -std::numeric_limits<float>::infinity());
    for (int c = 0; c < s.head_dim; ++c) EXPECT_EQ(out.o.at(0, 0, i, c), 0.0f);
  }
  EXPECT_TRUE(std::isfinite(out.lse[s.seq_q - s.seq_kv]));
}

// ---- the paper's orderings (SageAttention3 Table 1, Table 16) ------------------------

struct Variants {
  double nvfp4, mxfp4, two_level, direct, none, k_only, q_only, qk;
};

Variants measure(std::uint64_t seed) {
  const auto in = emulate::make_synthetic(small_spec(seed));
  Variants r{};
  Sage3Options o;
  r.nvfp4 = r.two_level = r.qk = cos_vs_reference(in, o);
  o.format = Fp4Format::MxFp4;
  r.mxfp4 = cos_vs_reference(in, o);
  o = {};
  o.p_scaling = PScaling::Direct;
  r.direct = cos_vs_reference(in, o);
  o = {};
  o.k_smoothing = emulate::KSmoothing::None;
  o.q_smoothing = QSmoothing::None;
  r.none = cos_vs_reference(in, o);
  o.k_smoothing = emulate::KSmoothing::Mean;
  r.k_only = cos_vs_reference(in, o);
  o.k_smoothing = emulate::KSmoothing::None;
  o.q_smoothing = QSmoothing::BlockMean;
  r.q_only = cos_vs_reference(in, o);
  return r;
}

TEST(Sage3, PaperOrderingsOnFixedSeeds) {
  for (std::uint64_t seed : {101u, 202u}) {
    SCOPED_TRACE(seed);
    const Variants v = measure(seed);
    EXPECT_GT(v.nvfp4, v.mxfp4);
    EXPECT_GT(v.two_level, v.direct);
    EXPECT_GT(v.qk, v.none);
    EXPECT_GT(v.k_only, v.none);
  }
}

// Fresh inputs each run (seed printed on failure): the threshold and the orderings with
// wide margins on this generator (NVFP4 vs MXFP4 ~0.01, smoothing ~0.02). Two-level vs
// direct is left to the fixed seeds: inside the kernel P̃ = exp(S − m) keeps block
// maxima near 1 on these rows, so its margin is ~1e-4 (min 1.5e-5 over 40 seeds) —
// see docs/accuracy-report.md.
TEST(Sage3, FreshRandomInputs) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  const Variants v = measure(seed);
  EXPECT_GT(v.nvfp4, kNvfp4CosMin);
  EXPECT_GT(v.nvfp4, v.mxfp4);
  EXPECT_GT(v.qk, v.none);
}

// ---- the representable-value count of SageAttention3 Appendix A.10 --------------------

TEST(Sage3, DirectPHasAtMost280DistinctValuesTwoLevelMany) {
  const auto in = emulate::make_synthetic(small_spec(5));
  emulate::Sage3PTrace direct, two_level;
  Sage3Options o;
  o.p_scaling = PScaling::Direct;
  sage3_attention(in.q, in.k, in.v, {}, o, &direct);
  sage3_attention(in.q, in.k, in.v, {}, {}, &two_level);
  const std::set<float> dset(direct.p_dequantized.begin(), direct.p_dequantized.end());
  const std::set<float> tset(two_level.p_dequantized.begin(), two_level.p_dequantized.end());
  EXPECT_EQ(direct.p_dequantized.size(), std::size_t(2 * 256 * 256));
  // 35 E4M3 scales in [0, 1/6] × 8 E2M1 magnitudes.
  EXPECT_LE(dset.size(), 35u * 8u);
  EXPECT_GT(tset.size(), 10 * dset.size());
}

// docs/design.md, Numerics: a NaN input gives NaN in the affected outputs, never a silent number.
// A NaN in query row 5 poisons its 64-row Q block (the block mean of Q smoothing and
// the FP4 block scale) and nothing else.
TEST(Sage3, NanInQueryReachesItsOutputs) {
  SyntheticSpec s = small_spec(8);
  s.heads_q = s.heads_kv = 1;
  auto in = emulate::make_synthetic(s);
  in.q.at(0, 0, 5, 3) = std::numeric_limits<float>::quiet_NaN();
  const auto out = sage3_attention(in.q, in.k, in.v, {});
  EXPECT_TRUE(std::isnan(out.lse[5]));
  for (int c = 0; c < s.head_dim; ++c) EXPECT_TRUE(std::isnan(out.o.at(0, 0, 5, c)));
  for (int i = 64; i < s.seq_q; ++i) {
    EXPECT_TRUE(std::isfinite(out.lse[i]));
    EXPECT_TRUE(std::isfinite(out.o.at(0, 0, i, 0)));
  }
}

// ---- bad inputs -----------------------------------------------------------------------

TEST(Sage3, RejectsBadArguments) {
  SyntheticSpec s = small_spec(6);
  s.head_dim = 48;  // a multiple of 16, not of 32
  s.seq_q = s.seq_kv = 64;
  const auto in = emulate::make_synthetic(s);
  EXPECT_NO_THROW(sage3_attention(in.q, in.k, in.v, {}));
  Sage3Options mx;
  mx.format = Fp4Format::MxFp4;
  EXPECT_THROW(sage3_attention(in.q, in.k, in.v, {}, mx), std::invalid_argument);
  Sage3Options given;
  given.k_smoothing = emulate::KSmoothing::Given;
  EXPECT_THROW(sage3_attention(in.q, in.k, in.v, {}, given), std::invalid_argument);
  Tensor4 bad_v(1, 1, 64, 48);  // heads differ from k's
  EXPECT_THROW(sage3_attention(in.q, in.k, bad_v, {}), std::invalid_argument);
  AttentionParams p;
  p.sm_scale = std::numeric_limits<double>::infinity();
  EXPECT_THROW(sage3_attention(in.q, in.k, in.v, p), std::invalid_argument);
}

}  // namespace
}  // namespace qattn
