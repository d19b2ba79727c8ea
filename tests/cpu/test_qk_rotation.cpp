// The Hadamard rotation of Q and K before their quantization (numerics/hadamard.h,
// emulate::QkRotation): it is orthogonal with scales that multiply to exactly 1/D, it
// changes Q·Kᵀ only by rounding, it spreads a spike over every channel, and in the SA2
// emulator it cuts INT8 Q·Kᵀ's error on heavy-tailed inputs while leaving a Gaussian
// head's as it was (docs/accuracy-report.md, "qk_rotation").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <stdexcept>
#include <vector>

#include "emulate/sage2.h"
#include "emulate/synthetic.h"
#include "numerics/hadamard.h"
#include "numerics/mma_groups.h"
#include "test_seed.h"

namespace qattn {
namespace {

std::vector<float> rotated(std::vector<float> x, bool for_q) {
  numerics::hadamard_rotate(x.data(), static_cast<int>(x.size()), for_q);
  return x;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Small integers: every butterfly sum is exact in FP32 and both scales are powers of
// two, so the rotated dot product equals the original exactly.
TEST(HadamardRotation, KeepsTheDotProductExactlyOnSmallIntegers) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(-20, 20);
  for (int d : {64, 128, 256}) {
    std::vector<float> q(d), k(d);
    for (int c = 0; c < d; ++c) q[c] = static_cast<float>(pick(rng)), k[c] = static_cast<float>(pick(rng));
    EXPECT_EQ(dot(rotated(q, true), rotated(k, false)), dot(q, k)) << "d=" << d;
    // |xR_q|² = |x|²·D/4^⌈m/2⌉ and |xR_k|² = |x|²·D/4^⌊m/2⌋: 1 and 1 at D = 64, 1/2 and
    // 2 at D = 128.
    const double m = std::log2(d), nq = d / std::pow(4.0, std::ceil(m / 2)),
                 nk = d / std::pow(4.0, std::floor(m / 2));
    EXPECT_EQ(dot(rotated(q, true), rotated(q, true)), nq * dot(q, q));
    EXPECT_EQ(dot(rotated(k, false), rotated(k, false)), nk * dot(k, k));
  }
}

// One large element (a heavy tail's) becomes D elements of equal magnitude.
TEST(HadamardRotation, SpreadsASpikeOverEveryChannel) {
  for (int at : {0, 37, 127}) {
    std::vector<float> x(128, 0.0f);
    x[at] = 16.0f;
    const std::vector<float> r = rotated(x, false);  // scale 2^-3 at D = 128
    int plus = 0;
    for (float v : r) {
      ASSERT_EQ(std::fabs(v), 2.0f);
      plus += v > 0;
    }
    // Row `at` of the Sylvester matrix: all +1 for row 0, else half +1 and half -1.
    if (at == 0)
      EXPECT_TRUE(plus == 0 || plus == 128);
    else
      EXPECT_EQ(plus, 64);
  }
}

constexpr double kU = 0x1p-24;  // FP32's unit roundoff (round to nearest)

// γ_n = n·u/(1 − n·u): the relative error bound of n chained roundings with unit
// roundoff u (Higham, Accuracy and Stability of Numerical Algorithms, §3.1).
double gamma_n(int n, double u = kU) { return n * u / (1.0 - n * u); }

emulate::SyntheticInputs family(emulate::InputFamily f, std::uint64_t seed, int heads, int n) {
  emulate::SyntheticSpec s;
  s.heads_q = s.heads_kv = heads;
  s.seq_q = s.seq_kv = n;
  s.head_dim = 128;
  s.seed = seed;
  s.family = f;
  return emulate::make_synthetic(s);
}

double norm1(const float* x, int d) {
  double s = 0.0;
  for (int c = 0; c < d; ++c) s += std::fabs(static_cast<double>(x[c]));
  return s;
}

double norm_sq(const float* x, int d) {
  double s = 0.0;
  for (int c = 0; c < d; ++c) s += static_cast<double>(x[c]) * x[c];
  return s;
}

double norm2(const float* x, int d) { return std::sqrt(norm_sq(x, d)); }

// With FP32 products the rotation changes nothing the attention reads but the two
// operands, and their dot products (the scores) by the butterflies' FP32 rounding only.
TEST(QkRotation, ChangesUnquantizedScoresByRoundingOnly) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const auto in = family(emulate::InputFamily::HeavyTail, seed, 2, 512);
  emulate::Sage2Options exact;
  exact.qk_format = emulate::QkFormat::Fp32;
  exact.pv_format = emulate::PvFormat::Fp32;
  emulate::Sage2Options rot = exact;
  rot.qk_rotation = emulate::QkRotation::Hadamard;
  const auto a = emulate::quantize_sage2(in.q, in.k, in.v, AttentionParams{}, exact);
  const auto b = emulate::quantize_sage2(in.q, in.k, in.v, AttentionParams{}, rot);
  // Exact: the rotation touches Q and K - c only. K's mean, q·c (the LSE's share), the
  // score scales and V are the unrotated call's bit for bit, so sage2_attend's two runs
  // differ in their scores alone.
  EXPECT_EQ(a.k_mean, b.k_mean);
  EXPECT_EQ(a.q_dot_c, b.q_dot_c);
  EXPECT_EQ(a.q_row_scale, b.q_row_scale);
  EXPECT_EQ(a.k_token_scale, b.k_token_scale);
  EXPECT_EQ(a.v_value, b.v_value);
  EXPECT_EQ(a.v_scale, b.v_scale);
  const int D = a.head_dim_padded, m = 7;  // D = 128 = 2^m
  ASSERT_EQ(D, 1 << m);
  // Exact: the operands are numerics::hadamard_rotate of the unrotated ones, every row
  // of the workspace (zero tails stay zero).
  for (const bool for_q : {true, false}) {
    const std::vector<float>& plain = for_q ? a.q_f32 : a.k_f32;
    const std::vector<float>& turned = for_q ? b.q_f32 : b.k_f32;
    ASSERT_EQ(plain.size(), turned.size());
    for (std::size_t r = 0; r < plain.size() / D; ++r) {
      std::vector<float> want(plain.begin() + r * D, plain.begin() + (r + 1) * D);
      numerics::hadamard_rotate(want.data(), D, for_q);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), turned.begin() + r * D))
          << (for_q ? "q" : "k") << " row " << r;
    }
  }
  // The scores, as sage2_attend forms them before the cast (an FP64 sum of FP32
  // products). Each rotated element is Σ ±x_c after m FP32 additions, so it errs by at
  // most γ_m·2^-e·|x|₁ (signs and the 2^-e scale are exact); with |qR|₁ <= √D·|qR|₂ =
  // 2^-e_q·D·|q|₂ and 2^-(e_q + e_k) = 1/D,
  //   |qR·kR' − q·k| <= γ_m·(|q|₂|k|₁ + |q|₁|k|₂) + γ_m²·|q|₁|k|₁,
  // plus each FP64 sum's γ_D (in FP64's unit roundoff) of Σ|q_c k_c|, which is at most
  // |q|₂|k|₂, or (1 + √D·γ_m)²·|q|₂|k|₂ for the rotated rows.
  const double gm = gamma_n(m), gd = gamma_n(D, 0x1p-53);
  for (int h = 0; h < a.heads_q; ++h)
    for (int i = 0; i < a.seqlen_q; ++i) {
      const std::size_t qr = (static_cast<std::size_t>(h) * a.nq_pad + i) * D;
      const float* q = a.q_f32.data() + qr;
      const float* qb = b.q_f32.data() + qr;
      const double q1 = norm1(q, D), q2 = norm2(q, D);
      for (int j = 0; j < a.seqlen_kv; ++j) {
        const std::size_t kr = (static_cast<std::size_t>(h) * a.nkv_pad + j) * D;
        const float* k = a.k_f32.data() + kr;
        const float* kb = b.k_f32.data() + kr;
        double plain = 0.0, turned = 0.0;
        for (int c = 0; c < D; ++c) {
          plain += static_cast<double>(q[c]) * k[c];
          turned += static_cast<double>(qb[c]) * kb[c];
        }
        const double k1 = norm1(k, D), k2 = norm2(k, D);
        const double bound = gm * (q2 * k1 + q1 * k2) + gm * gm * q1 * k1 +
                             2.0 * gd * std::pow(1.0 + std::sqrt(D) * gm, 2) * q2 * k2;
        ASSERT_LE(std::fabs(turned - plain), bound) << "head " << h << " row " << i << " key " << j;
      }
    }
}

// ---- INT8 Q·Kᵀ's score error with and without the rotation ---------------------------
//
// Under the standard rounding model, an INT8 code of a group with amax A has step
// A/127 and errs by δ uniform in ±½ step (variance step²/12), independently per code.
// A score (log2 units, scale_log2 folded into the Q step a_i; K step b_j) then errs by
//   e_ij = q̃_i·δk_j + k̃_j·δq_i + δq_i·δk_j,
//   E[e_ij²] = (a_i²|k̃_j|² + b_j²·scale_log2²·|q̃_i|²)/12 + D·a_i²b_j²/144,
// q̃, k̃ the operands that were quantized (rotated or not). Per head, with κ_Q² the
// mean over Q groups of (A/RMS)² (a crest factor; RMS over the head's q̃) and κ_K² K's,
// the mean of that over all pairs is
//   scale_log2²·D·mean(q̃²)·mean(k̃²)/(12·127²) · F(κ_Q², κ_K²),
//   F(x, y) = x + y + x·y/(12·127²),
// and the rotation keeps mean(q̃²)·mean(k̃²) (its scales multiply to 1/D, H·Hᵀ = D·I):
// the rotation moves the error through the crest factors alone.

constexpr int kQGroupSize = 2 * 128;   // two rows of 128 channels (numerics/mma_groups.h)
constexpr int kKGroupSize = 32 * 128;  // 32 tokens of a 128-token tile

// A group's amax² over its RMS² fluctuates, for Gaussian elements, with the extreme-value
// limit's spread: max|Z| ≈ a + G/a (a = √(2 ln 2n), G Gumbel, standard deviation π/√6),
// so max Z² ≈ a² + 2G has standard deviation 2π/√6 whatever n; the mean of N groups'
// has 2π/√(6N).
double crest_se(std::size_t groups) {
  return 2.0 * std::numbers::pi / std::sqrt(6.0 * static_cast<double>(groups));
}

double mean_of(const std::vector<double>& x) {
  double s = 0.0;
  for (double v : x) s += v;
  return s / static_cast<double>(x.size());
}

struct Crest {
  double mean = 0.0, se = 0.0;  // κ² (the mean over groups) and crest_se of the groups
};

Crest crest_of(const std::vector<double>& x) { return {mean_of(x), crest_se(x.size())}; }

struct HeadCrest {
  double mean_sq_q = 0.0, mean_sq_k = 0.0;  // mean(q̃²), mean(k̃²)
  Crest q, k;                               // κ_Q², κ_K² over the head's groups
};

struct ScoreErrors {
  double mse = 0.0;       // measured mean of e_ij² over all pairs (log2 units)
  double model = 0.0;     // the rounding model's expectation of it
  double model_sd = 0.0;  // ... and its standard deviation (below)
  double worst = 0.0;     // max over pairs of |e_ij| / its worst-case bound
  std::vector<HeadCrest> heads;
  Crest q, k;  // κ_Q², κ_K² over every head's groups
};

double crest_f(double x, double y) { return x + y + x * y / (12.0 * 127.0 * 127.0); }

// Needs heads_q == heads_kv, seq_q == seq_kv a multiple of 128 and d = 128.
ScoreErrors score_errors(const emulate::SyntheticInputs& in, emulate::QkRotation rotation) {
  emulate::Sage2Options o;  // the kernel's INT8 per-thread Q·Kᵀ
  o.qk_rotation = rotation;
  const auto z = emulate::quantize_sage2(in.q, in.k, in.v, AttentionParams{}, o);
  const int H = z.heads_q, n = z.seqlen_q, D = z.head_dim_padded;
  const double sl = z.scale_log2, gm = gamma_n(7);
  const std::size_t q_groups = z.q_blocks() * groups::kQThreadGroupsPerBlock;
  const std::size_t k_groups = z.kv_tiles() * groups::kKThreadGroupsPerTile;
  ScoreErrors r;
  std::vector<double> all_q, all_k;
  double var = 0.0;
  for (int h = 0; h < H; ++h) {
    // q and k - c as the emulator forms them, and the operands it quantizes.
    const float* c = z.k_mean.data() + static_cast<std::size_t>(h) * D;
    std::vector<float> q(static_cast<std::size_t>(n) * D), ks(q.size());
    for (int i = 0; i < n; ++i)
      for (int ch = 0; ch < D; ++ch) {
        q[i * D + ch] = in.q.at(0, h, i, ch);
        ks[i * D + ch] = in.k.at(0, h, i, ch) - c[ch];
      }
    std::vector<float> qt = q, kt = ks;
    if (rotation == emulate::QkRotation::Hadamard)
      for (int i = 0; i < n; ++i) {
        numerics::hadamard_rotate(qt.data() + i * D, D, true);
        numerics::hadamard_rotate(kt.data() + i * D, D, false);
      }
    std::vector<double> a(n), b(n), q1(n), q2(n), k1(n), k2(n), qt1(n), qt2(n), kt1(n), kt2(n);
    HeadCrest hc;
    for (int i = 0; i < n; ++i) {
      a[i] = z.q_row_scale[static_cast<std::size_t>(h) * z.nq_pad + i];
      b[i] = z.k_token_scale[static_cast<std::size_t>(h) * z.nkv_pad + i];
      q1[i] = norm1(&q[i * D], D), q2[i] = norm2(&q[i * D], D);
      k1[i] = norm1(&ks[i * D], D), k2[i] = norm2(&ks[i * D], D);
      qt1[i] = norm1(&qt[i * D], D), qt2[i] = norm_sq(&qt[i * D], D);
      kt1[i] = norm1(&kt[i * D], D), kt2[i] = norm_sq(&kt[i * D], D);
      hc.mean_sq_q += qt2[i] / (static_cast<double>(n) * D);
      hc.mean_sq_k += kt2[i] / (static_cast<double>(n) * D);
    }
    // Each group's amax from its step (q_scale has scale_log2 folded in).
    std::vector<double> gq, gk;
    for (std::size_t g = 0; g < q_groups; ++g) {
      const double amax = z.q_scale[h * q_groups + g] * 127.0 / sl;
      gq.push_back(amax * amax / hc.mean_sq_q);
    }
    for (std::size_t g = 0; g < k_groups; ++g) {
      const double amax = z.k_scale[h * k_groups + g] * 127.0;
      gk.push_back(amax * amax / hc.mean_sq_k);
    }
    hc.q = crest_of(gq), hc.k = crest_of(gk);
    all_q.insert(all_q.end(), gq.begin(), gq.end());
    all_k.insert(all_k.end(), gk.begin(), gk.end());
    r.heads.push_back(hc);
    // Each code's error variance: a²/12 (uniform within ½ step) for an element of a step
    // or more, and the element's own square below ½ step, where it rounds to 0 and errs
    // by itself (a heavy-tailed group, its step set by one outlier, is mostly such
    // elements: the uniform model alone overstates its error twofold).
    const auto code_var = [](double x, double step) {
      return std::fabs(x) < step / 2.0 ? x * x : step * step / 12.0;
    };
    std::vector<double> vq(q.size()), vk(q.size());
    for (int i = 0; i < n; ++i)
      for (int ch = 0; ch < D; ++ch) {
        vq[i * D + ch] = code_var(sl * qt[i * D + ch], a[i]);
        vk[i * D + ch] = code_var(kt[i * D + ch], b[i]);
      }
    for (int i = 0; i < n; ++i) {
      const std::int8_t* qc = z.q_i8.data() + (static_cast<std::size_t>(h) * z.nq_pad + i) * D;
      for (int j = 0; j < n; ++j) {
        const std::int8_t* kc = z.k_i8.data() + (static_cast<std::size_t>(h) * z.nkv_pad + j) * D;
        std::int32_t acc = 0;
        double exact = 0.0, abs_products = 0.0, model = 0.0;
        for (int ch = 0; ch < D; ++ch) {
          acc += static_cast<std::int32_t>(qc[ch]) * kc[ch];
          exact += static_cast<double>(q[i * D + ch]) * ks[j * D + ch];
          abs_products += std::fabs(static_cast<double>(qt[i * D + ch]) * kt[j * D + ch]);
          const double qv = vq[i * D + ch], kv = vk[j * D + ch];
          const double qx = sl * qt[i * D + ch], kx = kt[j * D + ch];
          model += qv * kx * kx + kv * qx * qx + qv * kv;
        }
        // The score as sage2_attend forms it, against the exact scale_log2·q·(k - c).
        const float scale = static_cast<float>(a[i]) * static_cast<float>(b[j]);
        const double score = static_cast<float>(acc) * scale;
        const double e = score - sl * exact;
        r.mse += e * e;
        r.model += model;
        // Worst case: every code within ½ step, |e| <= a/2·|k̃|₁ + b/2·scale_log2·|q̃|₁ +
        // D·a·b/4. FP32 roundings add, to first order, 4u of that (the Q step's
        // scale_log2, the scale product, the score's cast) and 9u of
        // scale_log2·Σ|q̃_c k̃_c| (each code's multiplier, product and step: 3u per
        // operand; the three above on the score itself), allowed as 8u and 12u to cover
        // the second-order terms; the rotation adds its butterflies' error (the test
        // above).
        double bound = (1.0 + 8.0 * kU) * (a[i] / 2.0 * kt1[j] + b[j] / 2.0 * sl * qt1[i] +
                                           D * a[i] * b[j] / 4.0) +
                       12.0 * kU * sl * abs_products;
        if (rotation == emulate::QkRotation::Hadamard)
          bound += sl * (gm * (q2[i] * k1[j] + q1[i] * k2[j]) + gm * gm * q1[i] * k1[j]);
        r.worst = std::max(r.worst, std::fabs(e) / bound);
      }
    }
    // The model's variance of Σe²: with G = Σ_i scale_log2²·q̃_i q̃_iᵀ, Σ_ij (q̃_i·δk_j)² =
    // Σ_j δk_jᵀ G δk_j, and a quadratic form in independent zero-mean codes of variance
    // s² (4th moment <= 3s⁴, as a uniform's 9s⁴/5) has variance <= 2s⁴·|G|_F²; the same
    // for the Q codes with G' = Σ_j k̃_j k̃_jᵀ, and the cross term 2Σ(q̃_i·δk_j)(k̃_j·δq_i)
    // has variance 4·Σ_i s_i²|q̃_i|²·Σ_j s_j²|k̃_j|²; the three are uncorrelated. Each code
    // is taken at the uniform model's s² = step²/12 here (over 60 seeds the measured
    // |mse - model| stays below 0.45 of the tolerance it gets).
    std::vector<double> gram_q(static_cast<std::size_t>(D) * D), gram_k(gram_q.size());
    for (int i = 0; i < n; ++i)
      for (int x = 0; x < D; ++x)
        for (int y = 0; y < D; ++y) {
          gram_q[x * D + y] += static_cast<double>(qt[i * D + x]) * qt[i * D + y];
          gram_k[x * D + y] += static_cast<double>(kt[i * D + x]) * kt[i * D + y];
        }
    double fq = 0.0, fk = 0.0;
    for (std::size_t t = 0; t < gram_q.size(); ++t)
      fq += gram_q[t] * gram_q[t], fk += gram_k[t] * gram_k[t];
    double sk4 = 0.0, sq4 = 0.0, sk2 = 0.0, sq2 = 0.0;
    for (int i = 0; i < n; ++i) {
      const double s2q = a[i] * a[i] / 12.0, s2k = b[i] * b[i] / 12.0;
      sq4 += s2q * s2q, sk4 += s2k * s2k;
      sq2 += s2q * sl * sl * qt2[i], sk2 += s2k * kt2[i];
    }
    var += 2.0 * sl * sl * sl * sl * fq * sk4 + 2.0 * fk * sq4 + 4.0 * sq2 * sk2;
  }
  const double pairs = static_cast<double>(H) * n * n;
  r.mse /= pairs, r.model /= pairs, r.model_sd = std::sqrt(var) / pairs;
  r.q = crest_of(all_q), r.k = crest_of(all_k);
  return r;
}

// E[max of n N(0, 1)²] <= (ln n − ½·ln(1 − 2λ))/λ for any λ < ½ (Jensen and a union
// bound over E[exp(λZ²)] = (1 − 2λ)^-½; no independence needed); λ = ½(1 − 1/ln n):
double gaussian_max_sq(int n) {
  const double l = std::log(static_cast<double>(n));
  return 2.0 * (l + 0.5 * std::log(l)) / (1.0 - 1.0 / l);
}

// Measured and model mean squared error agree within 6 of the model's standard
// deviations (a normal deviate beyond 6 has probability 2·10⁻⁹, for a test that draws
// a fresh seed every run) plus the model's one known bias: the amax code of each group
// errs by rounding only, not ½ step; 1 of the 2·128 codes of a Q group, 1 of the 32·128
// of a K group.
void expect_rounding_model(const ScoreErrors& s) {
  const double bias = s.model * (1.0 / kQGroupSize + 1.0 / kKGroupSize);
  EXPECT_LE(std::fabs(s.mse - s.model), 6.0 * s.model_sd + bias);
  EXPECT_LE(s.worst, 1.0);  // exact: no score beyond the worst case of ½-step codes
}

// INT8 Q·Kᵀ alone, on its scores: the rounding model and the worst case hold with and
// without the rotation; on Student-t₃ inputs the rotation brings each group's amax down
// to a Gaussian's (bench/NOTES.md v33f: heavy tails' error 12-16x lower in 1 - CosSim),
// and on Gaussian inputs, which it maps to inputs of the same distribution, it leaves
// the error as it was.
TEST(QkRotation, CutsTheHeavyTailErrorAndLeavesGaussianAlone) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const double sqrt_d = std::sqrt(128.0);
  const double gauss_q = gaussian_max_sq(kQGroupSize), gauss_k = gaussian_max_sq(kKGroupSize);

  const auto heavy = family(emulate::InputFamily::HeavyTail, seed, 4, 256);
  const ScoreErrors hu = score_errors(heavy, emulate::QkRotation::None);
  const ScoreErrors hr = score_errors(heavy, emulate::QkRotation::Hadamard);
  expect_rounding_model(hu);
  expect_rounding_model(hr);
  // A rotated row is its largest element spread evenly, |x_max|/√D in RMS units per
  // channel exactly (the spike test above), plus the rotation of the rest, a signed sum
  // of 128 terms and near Gaussian by the central limit theorem: its group amax² is
  // within a Gaussian's E[max²] (gaussian_max_sq, per group size; for t₃ sums an
  // approximation, their tails stay polynomial). By Minkowski, per head,
  //   κ_rotated <= √gaussian_max_sq(n) + κ_unrotated/√D
  // (measured: at most 0.58 of it over 300 seeds), allowing 6 of crest_se: the
  // allowance a Gaussian's group maxima need, not the spread these groups show (which
  // is a heavy tail's when the rotation fails).
  double bound_r = 0.0, unrotated = 0.0;  // the model's mean squared errors, up to a constant
  for (std::size_t h = 0; h < hu.heads.size(); ++h) {
    const HeadCrest &u = hu.heads[h], &r = hr.heads[h];
    const double bq = std::pow(std::sqrt(gauss_q) + std::sqrt(u.q.mean) / sqrt_d, 2) + 6.0 * r.q.se;
    const double bk = std::pow(std::sqrt(gauss_k) + std::sqrt(u.k.mean) / sqrt_d, 2) + 6.0 * r.k.se;
    EXPECT_LE(r.q.mean, bq) << "head " << h;
    EXPECT_LE(r.k.mean, bk) << "head " << h;
    bound_r += r.mean_sq_q * r.mean_sq_k * crest_f(bq, bk);
    unrotated += u.mean_sq_q * u.mean_sq_k * crest_f(u.q.mean, u.k.mean);
  }
  // Hence the rotated error over the unrotated one, through the model (each measured
  // error within its tolerance above): at most the derived factor, 0.06-0.29 in mean
  // squared error over 300 seeds (measured: 0.03-0.12).
  const double tol_u = (6.0 * hu.model_sd) / hu.model + 1.0 / kQGroupSize + 1.0 / kKGroupSize;
  const double tol_r = (6.0 * hr.model_sd) / hr.model;
  EXPECT_LE(hr.mse, hu.mse * (bound_r / unrotated) * (1.0 + tol_r) / (1.0 - tol_u));

  const auto gauss = family(emulate::InputFamily::Gaussian, seed, 4, 256);
  const ScoreErrors gu = score_errors(gauss, emulate::QkRotation::None);
  const ScoreErrors gr = score_errors(gauss, emulate::QkRotation::Hadamard);
  expect_rounding_model(gu);
  expect_rounding_model(gr);
  // Gaussian rows: the groups' mean (amax/RMS)² within a Gaussian's E[max²] (6 of
  // crest_se).
  for (const ScoreErrors* s : {&gu, &gr}) {
    EXPECT_LE(s->q.mean, gauss_q + 6.0 * s->q.se);
    EXPECT_LE(s->k.mean, gauss_k + 6.0 * s->k.se);
  }
  // The rotation maps i.i.d. N(0, σ²) channels (K - c) and N(0, σ²) plus an N(0, σ_b²)
  // bias vector (Q) to the same distributions, so both errors have one expectation; the
  // measured ratio is 1 up to the group maxima's sampling error (crest_se of κ_Q² and
  // κ_K²) and the rounding model's, 6 of them combined.
  const auto rel_se = [](const ScoreErrors& s) {
    return std::hypot(s.q.se, s.k.se) / (s.q.mean + s.k.mean);
  };
  const double sd =
      std::sqrt(std::pow(rel_se(gu), 2) + std::pow(rel_se(gr), 2) +
                std::pow(gu.model_sd / gu.model, 2) + std::pow(gr.model_sd / gr.model, 2));
  EXPECT_NEAR(gr.mse / gu.mse, 1.0, 6.0 * sd);
}

TEST(QkRotation, NeedsAPowerOfTwoHeadDim) {
  emulate::SyntheticSpec s;
  s.seq_q = s.seq_kv = 16;
  s.head_dim = 192;  // padded to 192
  const auto in = emulate::make_synthetic(s);
  emulate::Sage2Options o;
  o.qk_rotation = emulate::QkRotation::Hadamard;
  EXPECT_THROW(emulate::sage2_attention(in.q, in.k, in.v, AttentionParams{}, o),
               std::invalid_argument);
}

}  // namespace
}  // namespace qattn
