// The FP64 reference against an independent naive formula and against central
// finite differences; masking, GQA and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include "attention_test_util.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"

namespace qattn {
namespace {

using reference::attention_backward;
using reference::attention_forward;
using testutil::gaussian;
using testutil::gaussian_grid;

// Naive attention: the full score matrix, an explicit mask matrix, exp without the
// max shift (inputs are small), written independently of the reference's loop.
struct Naive {
  Tensor4d o;
  std::vector<double> lse;
};
Naive naive_forward(const Tensor4& q, const Tensor4& k, const Tensor4& v, bool causal,
                    double scale) {
  Naive r{Tensor4d(q.b, q.h, q.n, q.d), std::vector<double>(q.b * q.h * q.n)};
  const int rep = q.h / k.h;
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h) {
      std::vector<std::vector<double>> e(q.n, std::vector<double>(k.n, 0.0));
      for (int i = 0; i < q.n; ++i)
        for (int j = 0; j < k.n; ++j) {
          const int diag = i + (k.n - q.n);  // bottom-right alignment
          if (causal && j > diag) continue;
          double s = 0;
          for (int c = 0; c < q.d; ++c) s += double(q.at(b, h, i, c)) * k.at(b, h / rep, j, c);
          e[i][j] = std::exp(s * scale);
        }
      for (int i = 0; i < q.n; ++i) {
        double z = 0;
        for (double x : e[i]) z += x;
        r.lse[(b * q.h + h) * q.n + i] = std::log(z);  // log(0) = -inf for empty rows
        for (int c = 0; c < q.d; ++c) {
          double acc = 0;
          for (int j = 0; j < k.n; ++j) acc += e[i][j] * v.at(b, h / rep, j, c);
          r.o.at(b, h, i, c) = z > 0 ? acc / z : 0.0;
        }
      }
    }
  return r;
}

void expect_forward_matches_naive(int nq, int nkv, Mask mask, std::uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "nq=" << nq << " nkv=" << nkv << " seed=" << seed);
  const Tensor4 q = gaussian(2, 4, nq, 8, seed);
  const Tensor4 k = gaussian(2, 2, nkv, 8, seed + 1);
  const Tensor4 v = gaussian(2, 2, nkv, 8, seed + 2);
  const auto r = attention_forward(q, k, v, {mask, std::nullopt});
  const auto n = naive_forward(q, k, v, mask == Mask::Causal, 1.0 / std::sqrt(8.0));
  // Both are double evaluations of the same sums in other orders: ~1e-15 relative.
  for (std::size_t i = 0; i < r.o.size(); ++i) EXPECT_NEAR(r.o.data[i], n.o.data[i], 1e-12);
  for (std::size_t i = 0; i < r.lse.size(); ++i) {
    if (std::isinf(n.lse[i])) {
      EXPECT_EQ(r.lse[i], n.lse[i]);
    } else {
      EXPECT_NEAR(r.lse[i], n.lse[i], 1e-12);
    }
  }
}

TEST(ReferenceForward, MatchesNaiveFormula) {
  const std::uint64_t seed = testutil::fresh_seed();
  expect_forward_matches_naive(13, 13, Mask::None, seed);
  expect_forward_matches_naive(13, 13, Mask::Causal, seed);
}

TEST(ReferenceForward, CausalBottomRightFewerQueries) {
  expect_forward_matches_naive(5, 11, Mask::Causal, 7);
  // Query 0 sees keys 0..6 (= 0 + 11 - 5): check one masked and one visible pair
  // through the output: changing key 7 must not move row 0; changing key 6 must.
  Tensor4 q = gaussian(1, 1, 5, 4, 1), k = gaussian(1, 1, 11, 4, 2), v = gaussian(1, 1, 11, 4, 3);
  const AttentionParams causal{Mask::Causal, std::nullopt};
  const auto base = attention_forward(q, k, v, causal);
  Tensor4 v7 = v;
  v7.at(0, 0, 7, 0) += 10.0f;
  EXPECT_EQ(attention_forward(q, k, v7, causal).o.at(0, 0, 0, 0), base.o.at(0, 0, 0, 0));
  Tensor4 v6 = v;
  v6.at(0, 0, 6, 0) += 10.0f;
  EXPECT_NE(attention_forward(q, k, v6, causal).o.at(0, 0, 0, 0), base.o.at(0, 0, 0, 0));
}

TEST(ReferenceForward, CausalMoreQueriesGivesEmptyRows) {
  expect_forward_matches_naive(11, 5, Mask::Causal, 11);
  // Rows i < Nq - Nkv = 6 see nothing: O = 0 and LSE = -inf.
  const Tensor4 q = gaussian(1, 2, 11, 4, 4), k = gaussian(1, 1, 5, 4, 5),
                v = gaussian(1, 1, 5, 4, 6);
  const auto r = attention_forward(q, k, v, {Mask::Causal, std::nullopt});
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 11; ++i) {
      const double lse = r.lse[h * 11 + i];
      if (i < 6) {
        EXPECT_TRUE(std::isinf(lse) && lse < 0) << "row " << i;
        for (int c = 0; c < 4; ++c) EXPECT_EQ(r.o.at(0, h, i, c), 0.0);
      } else {
        EXPECT_TRUE(std::isfinite(lse)) << "row " << i;
      }
    }
}

TEST(ReferenceForward, SmScaleDefaultAndExplicit) {
  const Tensor4 q = gaussian(1, 1, 6, 16, 1), k = gaussian(1, 1, 9, 16, 2),
                v = gaussian(1, 1, 9, 16, 3);
  const auto a = attention_forward(q, k, v);
  const auto b = attention_forward(q, k, v, {Mask::None, 0.25});  // 1/sqrt(16)
  EXPECT_EQ(a.o.data, b.o.data);
  const auto c = attention_forward(q, k, v, {Mask::None, 0.7});
  const auto n = naive_forward(q, k, v, false, 0.7);
  for (std::size_t i = 0; i < c.o.size(); ++i) EXPECT_NEAR(c.o.data[i], n.o.data[i], 1e-12);
}

// GQA/MQA must equal plain multi-head attention on K/V repeated over each group, and
// its dK/dV must be the sum of the repeated heads' gradients.
TEST(ReferenceForward, GqaEqualsRepeatedKv) {
  const std::uint64_t seed = testutil::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed=" << seed);
  for (int hkv : {1, 2}) {
    const int hq = 4, rep = hq / hkv;
    const Tensor4 q = gaussian(2, hq, 7, 8, seed), k = gaussian(2, hkv, 10, 8, seed + 1),
                  v = gaussian(2, hkv, 10, 8, seed + 2), dout = gaussian(2, hq, 7, 8, seed + 3);
    Tensor4 kr(2, hq, 10, 8), vr(2, hq, 10, 8);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < hq; ++h)
        for (int j = 0; j < 10; ++j)
          for (int c = 0; c < 8; ++c) {
            kr.at(b, h, j, c) = k.at(b, h / rep, j, c);
            vr.at(b, h, j, c) = v.at(b, h / rep, j, c);
          }
    const AttentionParams p{Mask::Causal, std::nullopt};
    const auto g = attention_forward(q, k, v, p), m = attention_forward(q, kr, vr, p);
    for (std::size_t i = 0; i < g.o.size(); ++i) EXPECT_NEAR(g.o.data[i], m.o.data[i], 1e-14);
    const auto gb = attention_backward(q, k, v, dout, p),
               mb = attention_backward(q, kr, vr, dout, p);
    for (std::size_t i = 0; i < gb.dq.size(); ++i) EXPECT_NEAR(gb.dq.data[i], mb.dq.data[i], 1e-13);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < hkv; ++h)
        for (int j = 0; j < 10; ++j)
          for (int c = 0; c < 8; ++c) {
            double sk = 0, sv = 0;
            for (int r = 0; r < rep; ++r) {
              sk += mb.dk.at(b, h * rep + r, j, c);
              sv += mb.dv.at(b, h * rep + r, j, c);
            }
            EXPECT_NEAR(gb.dk.at(b, h, j, c), sk, 1e-13);
            EXPECT_NEAR(gb.dv.at(b, h, j, c), sv, 1e-13);
          }
  }
}

// Central differences of L = sum(O * dO) with step h = 2^-8 on inputs that lie on a
// 2^-10 grid (so x +- h is exact in float). The truncation error is h^2/6 * L''' ~
// 1e-5 for these O(1) inputs; 2e-4 absolute + 1e-3 relative leaves a safe margin
// while a wrong formula (a missing term, a wrong sign) is off by O(0.1).
void expect_backward_matches_fd(int nq, int nkv, Mask mask, std::uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "nq=" << nq << " nkv=" << nkv << " seed=" << seed);
  const int hq = 2, hkv = 1, d = 4;
  Tensor4 q = gaussian_grid(1, hq, nq, d, seed), k = gaussian_grid(1, hkv, nkv, d, seed + 1),
          v = gaussian_grid(1, hkv, nkv, d, seed + 2);
  const Tensor4 dout = gaussian_grid(1, hq, nq, d, seed + 3);
  const AttentionParams p{mask, 0.6};
  const auto g = attention_backward(q, k, v, dout, p);
  auto loss = [&]() {
    const auto r = attention_forward(q, k, v, p);
    double s = 0;
    for (std::size_t i = 0; i < r.o.size(); ++i) s += r.o.data[i] * dout.data[i];
    return s;
  };
  constexpr float kStep = 1.0f / 256.0f;
  auto check = [&](Tensor4& x, const Tensor4d& grad, const char* name) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float x0 = x.data[i];
      x.data[i] = x0 + kStep;
      const double lp = loss();
      x.data[i] = x0 - kStep;
      const double lm = loss();
      x.data[i] = x0;
      const double fd = (lp - lm) / (2.0 * kStep);
      EXPECT_NEAR(grad.data[i], fd, 2e-4 + 1e-3 * std::fabs(fd)) << name << "[" << i << "]";
    }
  };
  check(q, g.dq, "dq");
  check(k, g.dk, "dk");
  check(v, g.dv, "dv");
}

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  expect_backward_matches_fd(5, 5, Mask::None, testutil::fresh_seed());
  expect_backward_matches_fd(3, 6, Mask::Causal, 21);
}

TEST(ReferenceBackward, EmptyRowsHaveZeroGradients) {
  expect_backward_matches_fd(6, 3, Mask::Causal, 31);
  const Tensor4 q = gaussian(1, 1, 6, 4, 1), k = gaussian(1, 1, 3, 4, 2),
                v = gaussian(1, 1, 3, 4, 3), dout = gaussian(1, 1, 6, 4, 4);
  const auto g = attention_backward(q, k, v, dout, {Mask::Causal, std::nullopt});
  for (int i = 0; i < 3; ++i)  // rows 0..2 see nothing (j <= i - 3)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(g.dq.at(0, 0, i, c), 0.0);
}

TEST(ReferenceArgs, RejectsBadInputsNamingTheParameter) {
  const Tensor4 q = gaussian(1, 4, 4, 8, 1), k = gaussian(1, 2, 5, 8, 2),
                v = gaussian(1, 2, 5, 8, 3);
  auto expect_throw_naming = [](auto&& f, const char* name) {
    try {
      f();
      ADD_FAILURE() << "no exception for " << name;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  expect_throw_naming([&] { attention_forward(q, gaussian(1, 3, 5, 8, 2), v); }, "k");
  expect_throw_naming([&] { attention_forward(q, k, gaussian(1, 2, 6, 8, 3)); }, "v");
  expect_throw_naming([&] { attention_forward(q, gaussian(1, 2, 5, 4, 2), v); }, "k");
  expect_throw_naming([&] { attention_forward(q, k, v, {Mask::None, 0.0}); }, "sm_scale");
  expect_throw_naming(
      [&] {
        attention_forward(q, k, v, {Mask::None, std::numeric_limits<double>::infinity()});
      },
      "sm_scale");
  expect_throw_naming([&] { attention_forward(Tensor4(1, 4, 0, 8), k, v); }, "q");
  expect_throw_naming([&] { attention_backward(q, k, v, gaussian(1, 4, 3, 8, 1)); }, "dout");
}

TEST(ReferenceForward, NanInputGivesNanOutput) {
  Tensor4 q = gaussian(1, 1, 3, 4, 1);
  const Tensor4 k = gaussian(1, 1, 3, 4, 2), v = gaussian(1, 1, 3, 4, 3);
  q.at(0, 0, 1, 2) = std::numeric_limits<float>::quiet_NaN();
  const auto r = attention_forward(q, k, v);
  EXPECT_TRUE(std::isnan(r.o.at(0, 0, 1, 0)));
  EXPECT_TRUE(std::isnan(r.lse[1]));
  EXPECT_FALSE(std::isnan(r.o.at(0, 0, 0, 0)));
}

TEST(Metrics, FormulasOnAKnownPair) {
  const std::vector<float> o = {1.0f, 2.0f, -1.0f, 0.0f};
  const std::vector<double> r = {1.0, 1.0, -1.0, 1.0};
  const auto m = metrics::compare(o, r);
  EXPECT_DOUBLE_EQ(m.cos_sim, 4.0 / std::sqrt(6.0 * 4.0));
  EXPECT_DOUBLE_EQ(m.rel_l1, 2.0 / 4.0);
  EXPECT_DOUBLE_EQ(m.rmse, std::sqrt(2.0 / 4.0));
  EXPECT_DOUBLE_EQ(m.max_abs, 1.0);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> a = {-inf, 1.0}, b = {-inf, 2.0};
  const auto mi = metrics::compare(std::span<const double>(a), std::span<const double>(b));
  EXPECT_EQ(mi.count, 1u);
  EXPECT_DOUBLE_EQ(mi.max_abs, 1.0);
  EXPECT_THROW(metrics::compare(o, std::vector<double>{1.0}), std::invalid_argument);
}


// ---- V's head dim d_v different from Q·K's d (MLA-style 192/128) ----------------------

// V with its own head dim, and the same V zero-padded (or cut) to d columns: the
// probabilities do not depend on V, so O's common columns, the LSE and dQ, dK are equal
// exactly (FP64 sums of the same terms in the same order; the padded columns add
// zeros), and the padded columns of O and dV are zero.
Tensor4 with_columns(const Tensor4& v, int dv) {
  Tensor4 r(v.b, v.h, v.n, dv);
  for (int b = 0; b < v.b; ++b)
    for (int h = 0; h < v.h; ++h)
      for (int n = 0; n < v.n; ++n)
        for (int c = 0; c < std::min(dv, v.d); ++c) r.at(b, h, n, c) = v.at(b, h, n, c);
  return r;
}

TEST(ReferenceHeadDimV, OutputColumnsFollowVAlone) {
  for (auto [d, dv] : {std::pair{48, 32}, std::pair{24, 40}}) {
    SCOPED_TRACE("d=" + std::to_string(d) + " d_v=" + std::to_string(dv));
    const Tensor4 q = gaussian(2, 4, 33, d, 11), k = gaussian(2, 2, 45, d, 12);
    const Tensor4 v = gaussian(2, 2, 45, dv, 13), vd = with_columns(v, d);
    AttentionParams p;
    p.mask = Mask::Causal;
    p.window_left = 20;
    const auto a = reference::attention_forward(q, k, v, p);
    const auto w = reference::attention_forward(q, k, vd, p);
    ASSERT_EQ(a.o.d, dv);
    EXPECT_EQ(a.lse, w.lse);
    for (int b = 0; b < q.b; ++b)
      for (int h = 0; h < q.h; ++h)
        for (int i = 0; i < q.n; ++i)
          for (int c = 0; c < d; ++c) {  // w's columns: V's (cut to d, or padded with zeros)
            const double want = w.o.at(b, h, i, c);
            ASSERT_EQ(c < dv ? a.o.at(b, h, i, c) : 0.0, want) << b << "," << h << "," << i << "," << c;
          }
    // The backward: dO has O's shape; dQ and dK equal those of the padded V with dO
    // padded alike (its extra columns meet zeros), dV the common columns.
    const Tensor4 dout = gaussian(2, 4, 33, dv, 14), dout_d = with_columns(dout, d);
    const auto g = reference::attention_backward(q, k, v, dout, p);
    const auto gw = reference::attention_backward(q, k, vd, dout_d, p);
    ASSERT_EQ(g.dv.d, dv);
    if (dv <= d) {  // dO's columns past dv are zero in dout_d: dP equal
      EXPECT_EQ(g.dq.data, gw.dq.data);
      EXPECT_EQ(g.dk.data, gw.dk.data);
    }
    for (int b = 0; b < k.b; ++b)
      for (int h = 0; h < k.h; ++h)
        for (int j = 0; j < k.n; ++j)
          for (int c = 0; c < std::min(d, dv); ++c)
            ASSERT_EQ(g.dv.at(b, h, j, c), gw.dv.at(b, h, j, c));
  }
}

TEST(ReferenceHeadDimV, VarlenAndBadShapes) {
  const VarlenLayout lay = VarlenLayout::from_lengths({5, 0, 9}, {7, 3, 9});
  PackedTensor q(14, 2, 16), k(19, 1, 16), v(19, 1, 24);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (auto* t : {&q, &k, &v})
    for (float& x : t->data) x = nd(rng);
  const auto r = reference::attention_forward_varlen(q, k, v, lay, {});
  EXPECT_EQ(r.o.d, 24);
  // V must match K in everything but its head dim.
  EXPECT_THROW(reference::attention_forward(gaussian(1, 2, 4, 8, 1), gaussian(1, 2, 5, 8, 2),
                                            gaussian(1, 2, 6, 12, 3)),
               std::invalid_argument);
  // The backward's dO has O's shape (d_v), not Q's.
  EXPECT_THROW(reference::attention_backward(gaussian(1, 2, 4, 8, 1), gaussian(1, 2, 5, 8, 2),
                                             gaussian(1, 2, 5, 12, 3), gaussian(1, 2, 4, 8, 4)),
               std::invalid_argument);
}

}  // namespace
}  // namespace qattn
