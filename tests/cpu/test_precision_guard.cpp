// The precision guard (issue 22) on the CPU: the input families are generated as their
// recipes say (emulate/synthetic.h), the guard's threshold and statistic follow their
// derivation (emulate/precision.h), auto is precise bit for bit on the flagged heads and
// fast on the others, and precise meets issue 22's CosSim target on every family.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <stdexcept>
#include <vector>

#include "emulate/precision.h"
#include "emulate/sage2.h"
#include "emulate/synthetic.h"
#include "numerics/formats.h"
#include "numerics/precision_guard.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "test_seed.h"

namespace qattn {
namespace {

using emulate::InputFamily;
using emulate::Precision;
using emulate::SyntheticSpec;

// Small inputs, a few heads: every test here runs in well under a second.
SyntheticSpec small_spec(InputFamily f, std::uint64_t seed, int heads = 2, int n = 256,
                         int d = 128) {
  SyntheticSpec s;
  s.heads_q = s.heads_kv = heads;
  s.seq_q = s.seq_kv = n;
  s.head_dim = d;
  s.seed = seed;
  s.family = f;
  return s;
}

// FP16's smallest normal magnitude: above it, scaling by a power of two (no overflow)
// commutes with the rounding to FP16, so the families' relations below are exact there.
constexpr float kFp16MinNormal = 6.103515625e-05f;  // 2^-14

double cos_against_reference(const Tensor4& o, const reference::ForwardResult& r) {
  return metrics::compare(o.data, r.o.data).cos_sim;
}

// ---- the families -------------------------------------------------------------------

TEST(InputFamilies, LargeLogitsIsTheGaussianQueryTimesLambda) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const auto g = emulate::make_synthetic(small_spec(InputFamily::Gaussian, seed));
  SyntheticSpec s = small_spec(InputFamily::LargeLogits, seed);
  const auto l = emulate::make_synthetic(s);
  ASSERT_EQ(s.large_logit_scale, 8.0);  // the documented recipe
  EXPECT_EQ(l.k.data, g.k.data);
  EXPECT_EQ(l.v.data, g.v.data);
  for (std::size_t i = 0; i < g.q.size(); ++i) {
    if (std::fabs(g.q.data[i]) < kFp16MinNormal) continue;
    ASSERT_EQ(l.q.data[i], 8.0f * g.q.data[i]) << "element " << i;
  }
  // λ = 1 is the Gaussian recipe itself.
  s.large_logit_scale = 1.0;
  EXPECT_EQ(emulate::make_synthetic(s).q.data, g.q.data);
}

// Student-t(3) at unit variance: its median |t| is t₃'s 75% quantile (0.76489) / √3 =
// 0.44161, against 0.67449 for N(0, 1); over 256·128 = 32768 values the sample median's
// standard error is ~0.5%, so 3% separates the two by far. Its tails: P(|x| > 5) =
// P(|t₃| > 5√3) = 3.3e-3, against 5.7e-7 for N(0, 1).
TEST(InputFamilies, HeavyTailIsUnitVarianceStudentT3) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const auto h = emulate::make_synthetic(small_spec(InputFamily::HeavyTail, seed));
  for (const Tensor4* t : {&h.v, &h.dout}) {  // no bias: the noise alone
    std::vector<float> a(t->data.size());
    std::transform(t->data.begin(), t->data.end(), a.begin(), [](float x) { return std::fabs(x); });
    std::nth_element(a.begin(), a.begin() + a.size() / 2, a.end());
    EXPECT_NEAR(a[a.size() / 2], 0.44161, 0.03 * 0.44161);
    const auto beyond5 = std::count_if(a.begin(), a.end(), [](float x) { return x > 5.0f; });
    EXPECT_GT(static_cast<double>(beyond5) / a.size(), 1e-3);
  }
}

TEST(InputFamilies, OutlierChannelsMoveMagnitudeBetweenQAndK) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const SyntheticSpec s = small_spec(InputFamily::OutlierChannels, seed);
  const auto g = emulate::make_synthetic(small_spec(InputFamily::Gaussian, seed));
  const auto o = emulate::make_synthetic(s);
  EXPECT_EQ(o.v.data, g.v.data);
  const int d = s.head_dim;
  for (int h = 0; h < s.heads_kv; ++h) {
    const emulate::OutlierChannelSets sets = emulate::outlier_channel_sets(s, 0, h);
    ASSERT_EQ(sets.k_large.size(), static_cast<std::size_t>(d / 32));  // max(1, d/32)
    ASSERT_EQ(sets.q_large.size(), static_cast<std::size_t>(d / 32));
    std::vector<float> kf(d, 1.0f), qf(d, 1.0f);
    for (int c : sets.k_large) kf[c] = 32.0f, qf[c] = 1.0f / 32.0f;
    for (int c : sets.q_large) {
      ASSERT_EQ(kf[c], 1.0f) << "channel " << c << " in both sets";
      qf[c] = 32.0f, kf[c] = 1.0f / 32.0f;
    }
    for (int i = 0; i < s.seq_q; ++i)
      for (int c = 0; c < d; ++c) {
        // Exact where both values are FP16 normals (a power-of-two scale commutes with
        // the rounding there).
        const float gq = g.q.at(0, h, i, c), gk = g.k.at(0, h, i, c);
        if (std::fabs(gq * qf[c]) >= kFp16MinNormal && std::fabs(gq) >= kFp16MinNormal)
          ASSERT_EQ(o.q.at(0, h, i, c), gq * qf[c]) << "q row " << i << " channel " << c;
        if (std::fabs(gk * kf[c]) >= kFp16MinNormal && std::fabs(gk) >= kFp16MinNormal)
          ASSERT_EQ(o.k.at(0, h, i, c), gk * kf[c]) << "k row " << i << " channel " << c;
      }
  }
}

// The sink adds s·u to key 0 only, u the unit Q-bias direction, s = ln(N)·T·√d/|b_q|:
// every query's logit on key 0 rises by sm_scale·q·(s·u), on average ln N (the Q noise
// averages out over the rows; FP16 rounding moves k_0 by < 2^-11 relative).
TEST(InputFamilies, AttentionSinkRaisesKeyZeroByLnN) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const SyntheticSpec s = small_spec(InputFamily::AttentionSink, seed);
  const auto g = emulate::make_synthetic(small_spec(InputFamily::Gaussian, seed));
  const auto k = emulate::make_synthetic(s);
  EXPECT_EQ(k.q.data, g.q.data);
  EXPECT_EQ(k.v.data, g.v.data);
  const int d = s.head_dim;
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int h = 0; h < s.heads_kv; ++h) {
    for (int j = 1; j < s.seq_kv; ++j)
      for (int c = 0; c < d; ++c) ASSERT_EQ(k.k.at(0, h, j, c), g.k.at(0, h, j, c));
    double rise = 0.0;
    for (int i = 0; i < s.seq_q; ++i) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c)
        dot += static_cast<double>(g.q.at(0, h, i, c)) * (k.k.at(0, h, 0, c) - g.k.at(0, h, 0, c));
      rise += sm_scale * dot / s.seq_q;
    }
    // A row's rise is sm_scale·s·(|b_q| + z·u): ln N plus a term of std sm_scale·s =
    // ln N/|b_q| ≈ 1 across rows, so the mean over 256 rows is ln N ± 0.06; 0.4 also
    // covers the FP16 rounding of k_0 and stays far below ln N ≈ 5.5.
    EXPECT_NEAR(rise, std::log(static_cast<double>(s.seq_kv)), 0.4) << "head " << h;
  }
}

TEST(InputFamilies, BadFamilyParametersAreRefusedByName) {
  SyntheticSpec s = small_spec(InputFamily::HeavyTail, 1);
  s.student_t_dof = 2;
  EXPECT_THROW(emulate::make_synthetic(s), std::invalid_argument);
  s = small_spec(InputFamily::OutlierChannels, 1, 1, 16, 8);
  s.outlier_channels = 5;  // 2·5 > 8 channels
  EXPECT_THROW(emulate::make_synthetic(s), std::invalid_argument);
  s = small_spec(InputFamily::AttentionSink, 1);
  s.q_bias_std = 0.0;
  EXPECT_THROW(emulate::make_synthetic(s), std::invalid_argument);
  s = small_spec(InputFamily::LargeLogits, 1);
  s.large_logit_scale = 0.0;
  EXPECT_THROW(emulate::make_synthetic(s), std::invalid_argument);
}

// ---- the 16-bit Q·Kᵀ formats ----------------------------------------------------------

// On FP16 inputs with no smoothing, FP16 Q·Kᵀ rounds nothing: the same bits as FP32.
TEST(PrecisionSchemes, Fp16QkOnFp16InputsEqualsFp32Qk) {
  const auto in = emulate::make_synthetic(small_spec(InputFamily::Gaussian, 3, 1, 130));
  emulate::Sage2Options o = emulate::precise_options();
  const auto a = emulate::sage2_attention(in.q, in.k, in.v, {}, o);
  o.qk_format = emulate::QkFormat::Fp32;
  const auto b = emulate::sage2_attention(in.q, in.k, in.v, {}, o);
  EXPECT_EQ(a.o.data, b.o.data);
  EXPECT_EQ(a.lse, b.lse);
  // BF16 rounds Q and K: the scores move.
  o.qk_format = emulate::QkFormat::Bf16;
  EXPECT_NE(emulate::sage2_attention(in.q, in.k, in.v, {}, o).o.data, b.o.data);
}

// ---- the guard --------------------------------------------------------------------------

// The threshold is the RMS relative error of an E4M3 cast over log-uniform values: the
// closed form 2^-4/√(8 ln 2) against the cast itself on 2^16 log-spaced points of a
// binade (the grid's own error is far below the 1% allowed).
TEST(PrecisionGuard, ThresholdIsTheRmsRelativeErrorOfE4M3) {
  EXPECT_DOUBLE_EQ(emulate::guard_threshold_nats(), 0.0625 / std::sqrt(8.0 * std::numbers::ln2));
  constexpr int kPoints = 1 << 16;
  double sum = 0.0;
  for (int i = 0; i < kPoints; ++i) {
    const float x = static_cast<float>(std::exp2((i + 0.5) / kPoints));  // in [1, 2)
    const double rel = (numerics::e4m3_round(x) - x) / x;
    sum += rel * rel;
  }
  EXPECT_NEAR(std::sqrt(sum / kPoints), emulate::guard_threshold_nats(),
              0.01 * emulate::guard_threshold_nats());
}

// The statistic is the rounding model's σ of the worst (row, key) pair, so the RMS of
// the actual score errors over all pairs must lie below it, and not far below (a bound
// within 4x of what it bounds on these inputs, not a vacuous one).
TEST(PrecisionGuard, SigmaBoundsTheMeasuredScoreError) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits}) {
    SCOPED_TRACE(emulate::family_name(f));
    const auto in = emulate::make_synthetic(small_spec(f, seed, 1));
    const emulate::Sage2Quantized z =
        emulate::quantize_sage2(in.q, in.k, in.v, {}, emulate::fast_options());
    const emulate::PrecisionGuard g = emulate::precision_guard(z);
    const int n = in.q.n, d = in.q.d, D = z.head_dim_padded;
    double sum = 0.0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        std::int32_t acc = 0;
        double exact = 0.0;
        for (int c = 0; c < d; ++c) {
          acc += static_cast<std::int32_t>(z.q_i8[i * D + c]) * z.k_i8[j * D + c];
          exact += static_cast<double>(in.q.at(0, 0, i, c)) * (in.k.at(0, 0, j, c) - z.k_mean[c]);
        }
        const double quantized = static_cast<double>(acc) * z.q_row_scale[i] * z.k_token_scale[j];
        const double err = (quantized - exact * z.scale_log2) * std::numbers::ln2;  // nats
        sum += err * err;
      }
    const double rms = std::sqrt(sum / (static_cast<double>(n) * n));
    EXPECT_LE(rms, g.sigma_nats[0]);
    EXPECT_GE(rms, g.sigma_nats[0] / 4.0);
  }
}

TEST(PrecisionGuard, FlagsLargeLogitHeadsAndNotGaussianOnes) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits}) {
    const auto in = emulate::make_synthetic(small_spec(f, seed, 4));
    const emulate::PrecisionGuard g = emulate::precision_guard(
        emulate::quantize_sage2(in.q, in.k, in.v, {}, emulate::fast_options()));
    ASSERT_EQ(g.flagged.size(), 4u);
    for (std::size_t h = 0; h < 4; ++h) {
      EXPECT_EQ(g.flagged[h], f == InputFamily::LargeLogits ? 1 : 0)
          << emulate::family_name(f) << " head " << h << ": sigma " << g.sigma_nats[h];
    }
  }
}

// The GPU's form of the rule (numerics/precision_guard.h: four FP32 maxima per head and
// an FP32 formula) against the emulator's (FP64 products): equal σ to a few FP32
// roundings (relative 1e-6), the same float threshold, the same flags, on every family.
TEST(PrecisionGuard, TheGpusFp32FormIsTheEmulatorsRule) {
  EXPECT_FLOAT_EQ(numerics::kGuardThresholdNats, static_cast<float>(emulate::guard_threshold_nats()));
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits, InputFamily::HeavyTail,
                        InputFamily::OutlierChannels, InputFamily::AttentionSink}) {
    SyntheticSpec spec = small_spec(f, seed, 4);
    spec.heads_kv = 2;
    const auto in = emulate::make_synthetic(spec);
    const emulate::Sage2Quantized z =
        emulate::quantize_sage2(in.q, in.k, in.v, {}, emulate::fast_options());
    const emulate::PrecisionGuard g = emulate::precision_guard(z);
    const int D = z.head_dim_padded;
    auto norm2 = [D](const std::int8_t* c) {
      int s = 0;
      for (int i = 0; i < D; ++i) s += c[i] * c[i];
      return static_cast<float>(s);
    };
    for (int h = 0; h < z.heads_q; ++h) {
      float a2 = 0.f, qn = 0.f, b2 = 0.f, kn = 0.f;
      for (int i = 0; i < z.nq_pad; ++i) {
        const std::size_t r = std::size_t(h) * z.nq_pad + i;
        const float a = z.q_row_scale[r];
        a2 = std::max(a2, a * a);
        qn = std::max(qn, a * a * norm2(z.q_i8.data() + r * D));
      }
      const int hk = h / (z.heads_q / z.heads_kv);
      for (int j = 0; j < z.nkv_pad; ++j) {
        const std::size_t r = std::size_t(hk) * z.nkv_pad + j;
        const float b = z.k_token_scale[r];
        b2 = std::max(b2, b * b);
        kn = std::max(kn, b * b * norm2(z.k_i8.data() + r * D));
      }
      const float sigma = numerics::guard_sigma_nats(a2, qn, b2, kn);
      EXPECT_NEAR(sigma, g.sigma_nats[h], 1e-6 * g.sigma_nats[h]) << emulate::family_name(f) << " head " << h;
      EXPECT_EQ(numerics::guard_flags(sigma), g.flagged[h] != 0) << emulate::family_name(f) << " head " << h;
    }
  }
  EXPECT_TRUE(numerics::guard_flags(std::nanf("")));  // NaN never passes as small
}

TEST(PrecisionGuard, NeedsTheFastPathsIntegerQuantization) {
  const auto in = emulate::make_synthetic(small_spec(InputFamily::Gaussian, 1, 1, 64));
  EXPECT_THROW(emulate::precision_guard(
                   emulate::quantize_sage2(in.q, in.k, in.v, {}, emulate::precise_options())),
               std::invalid_argument);
}

// Heads 0 and 2 Gaussian, 1 and 3 large-logit (the two families share K and V; GQA with
// two Q heads per KV head, causal): auto flags 1 and 3 and takes each head's output and
// LSE bit for bit from the one scheme it names.
TEST(PrecisionGuard, AutoIsPreciseOnFlaggedHeadsAndFastElsewhere) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  SyntheticSpec s = small_spec(InputFamily::Gaussian, seed, 4, 200);
  s.heads_kv = 2;
  const auto g = emulate::make_synthetic(s);
  s.family = InputFamily::LargeLogits;
  const auto l = emulate::make_synthetic(s);
  ASSERT_EQ(g.k.data, l.k.data);
  Tensor4 q = g.q;
  const std::size_t head = static_cast<std::size_t>(s.seq_q) * s.head_dim;
  for (int h : {1, 3}) std::copy_n(l.q.data.begin() + h * head, head, q.data.begin() + h * head);
  AttentionParams p;
  p.mask = Mask::Causal;
  const auto fast = emulate::attention_with_precision(q, g.k, g.v, p, Precision::Fast);
  const auto precise = emulate::attention_with_precision(q, g.k, g.v, p, Precision::Precise);
  const auto automatic = emulate::attention_with_precision(q, g.k, g.v, p, Precision::Auto);
  ASSERT_EQ(automatic.guard.flagged, (std::vector<std::uint8_t>{0, 1, 0, 1}));
  EXPECT_EQ(automatic.precise, automatic.guard.flagged);
  EXPECT_EQ(fast.precise, (std::vector<std::uint8_t>(4, 0)));
  EXPECT_EQ(precise.precise, (std::vector<std::uint8_t>(4, 1)));
  for (int h = 0; h < 4; ++h) {
    const auto& want = automatic.guard.flagged[h] ? precise.fwd : fast.fwd;
    const auto& other = automatic.guard.flagged[h] ? fast.fwd : precise.fwd;
    const auto o0 = automatic.fwd.o.data.begin() + h * head;
    EXPECT_TRUE(std::equal(o0, o0 + head, want.o.data.begin() + h * head)) << "head " << h;
    EXPECT_FALSE(std::equal(o0, o0 + head, other.o.data.begin() + h * head)) << "head " << h;
    const auto l0 = automatic.fwd.lse.begin() + h * s.seq_q;
    EXPECT_TRUE(std::equal(l0, l0 + s.seq_q, want.lse.begin() + h * s.seq_q)) << "head " << h;
  }
}

// Issue 22's targets at a small size: precise >= 0.9999 on every family, auto >= 0.999
// on the large-logit family. The bounds are the issue's; the margin is wide (precise
// rounds only P̃ to FP16, 2^-11 relative: CosSim 1 − O(1e-7)), so any seed passes.
TEST(PrecisionGuard, PreciseMeetsTheTargetOnEveryFamily) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits, InputFamily::HeavyTail,
                        InputFamily::OutlierChannels, InputFamily::AttentionSink}) {
    SCOPED_TRACE(emulate::family_name(f));
    const auto in = emulate::make_synthetic(small_spec(f, seed));
    const auto ref = reference::attention_forward(in.q, in.k, in.v);
    const auto precise =
        emulate::attention_with_precision(in.q, in.k, in.v, {}, Precision::Precise);
    EXPECT_GE(cos_against_reference(precise.fwd.o, ref), 0.9999);
    if (f == InputFamily::LargeLogits) {
      const auto a = emulate::attention_with_precision(in.q, in.k, in.v, {}, Precision::Auto);
      EXPECT_GE(cos_against_reference(a.fwd.o, ref), 0.999);
    }
  }
}

// What decided "precise" (bench/NOTES.md, "Precision guard"), on seed 0: on the
// large-logit family INT8 Q·Kᵀ alone (P·V in FP16) costs more CosSim than FP8 P·V alone
// (Q·Kᵀ in FP16), and on every family FP8 P·V alone stays below 0.9999 (V's E4M3
// rounding, ~2.7% per element), so precise changes both products.
TEST(PrecisionSchemes, QkDominatesOnLargeLogitsAndFp8PvMissesTheTargetEverywhere) {
  emulate::Sage2Options qk8;
  qk8.pv_format = emulate::PvFormat::Fp16;
  emulate::Sage2Options pv8;
  pv8.qk_format = emulate::QkFormat::Fp16;
  pv8.k_smoothing = emulate::KSmoothing::None;
  for (InputFamily f : {InputFamily::Gaussian, InputFamily::LargeLogits, InputFamily::HeavyTail,
                        InputFamily::OutlierChannels, InputFamily::AttentionSink}) {
    SCOPED_TRACE(emulate::family_name(f));
    const auto in = emulate::make_synthetic(small_spec(f, 0));
    const auto ref = reference::attention_forward(in.q, in.k, in.v);
    const double cos_qk8 =
        cos_against_reference(emulate::sage2_attention(in.q, in.k, in.v, {}, qk8).o, ref);
    const double cos_pv8 =
        cos_against_reference(emulate::sage2_attention(in.q, in.k, in.v, {}, pv8).o, ref);
    EXPECT_LT(cos_pv8, 0.9999);
    if (f == InputFamily::LargeLogits) EXPECT_LT(cos_qk8, cos_pv8);
  }
}

}  // namespace
}  // namespace qattn
