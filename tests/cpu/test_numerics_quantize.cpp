// Block quantizers and smoothing: error bounds derived from each format, monotonicity,
// zero blocks, NaN/Inf propagation, the wgmma scale-group structure, and bad sizes.
// Random cases run on fixed seeds and on a fresh seed (printed on failure
// through SCOPED_TRACE; QATTN_TEST_SEED=<seed> reruns it).
#include <gtest/gtest.h>

#include "test_seed.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "numerics/block_scale.h"
#include "numerics/formats.h"
#include "numerics/mma_groups.h"
#include "numerics/quantize.h"

namespace qn = qattn::numerics;
using qn::Granularity;
using qn::Operand;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kEps = std::numeric_limits<float>::epsilon();

constexpr Granularity kAllGranularities[] = {Granularity::PerTensor,     Granularity::PerBlock,
                                             Granularity::PerWarp,       Granularity::PerThread,
                                             Granularity::PerToken,      Granularity::PerChannel,
                                             Granularity::PerTileChannel};
constexpr Operand kOperands[] = {Operand::Q, Operand::K};

// Runs body on two fixed seeds and one fresh seed, the seed in the failure trace.
void for_seeds(const std::function<void(std::mt19937&)>& body) {
  const unsigned seeds[] = {1u, 20261107u, qattn::test::fresh_seed32()};
  for (unsigned s : seeds) {
    SCOPED_TRACE(qattn::test::seed_trace(s));
    std::mt19937 gen(s);
    body(gen);
  }
}

// Gaussian entries with a per-channel offset, like K in attention (outlier channels).
std::vector<float> random_matrix(std::mt19937& gen, int64_t rows, int64_t cols,
                                 float offset_scale = 2.0f) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> bias(cols);
  for (auto& b : bias) b = offset_scale * n(gen);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = n(gen) + bias[c];
  }
  return x;
}

// Softmax-like rows: exp(s − rowmax) with s Gaussian of the given spread.
std::vector<float> random_probs(std::mt19937& gen, int64_t rows, int64_t cols, float spread) {
  std::normal_distribution<float> n(0.0f, spread);
  std::vector<float> p(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    float m = -kInf;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, p[r * cols + c] = n(gen));
    for (int64_t c = 0; c < cols; ++c) p[r * cols + c] = std::exp(p[r * cols + c] - m);
  }
  return p;
}

// Exact group amax computed independently of the library.
std::vector<float> reference_amax(const std::vector<float>& x, const qn::GroupMap& map) {
  std::vector<float> amax(map.count(), 0.0f);
  for (int64_t r = 0; r < map.rows; ++r) {
    for (int64_t c = 0; c < map.cols; ++c) {
      float& a = amax[map.group_of(r, c)];
      a = std::max(a, std::fabs(x[r * map.cols + c]));
    }
  }
  return amax;
}

std::string name(Granularity g, Operand op) {
  return "granularity " + std::to_string(static_cast<int>(g)) + (op == Operand::Q ? " Q" : " K");
}

}  // namespace

// ---- scale groups ---------------------------------------------------------------------------

TEST(GroupMap, CountsFollowTheWgmmaLayout) {
  const int64_t rows = 300, cols = 64;  // 300 = 4 full Q blocks + 44; 2 KV tiles + 44
  auto count = [&](Granularity g, Operand op) {
    return qn::make_group_map(g, op, rows, cols).count();
  };
  EXPECT_EQ(count(Granularity::PerTensor, Operand::Q), 1);
  EXPECT_EQ(count(Granularity::PerBlock, Operand::Q), 5);
  EXPECT_EQ(count(Granularity::PerBlock, Operand::K), 3);
  EXPECT_EQ(count(Granularity::PerWarp, Operand::Q), 19);
  EXPECT_EQ(count(Granularity::PerWarp, Operand::K), 3);
  EXPECT_EQ(count(Granularity::PerThread, Operand::Q), 5 * 32);
  EXPECT_EQ(count(Granularity::PerThread, Operand::K), 3 * 4);
  EXPECT_EQ(count(Granularity::PerToken, Operand::K), rows);
  EXPECT_EQ(count(Granularity::PerChannel, Operand::K), cols);
  EXPECT_EQ(count(Granularity::PerTileChannel, Operand::K), 3 * cols);
  EXPECT_EQ(count(Granularity::PerTileChannel, Operand::Q), 5 * cols);
}

TEST(GroupMap, PerThreadGroupsHoldTheFragmentRows) {
  // Q: every 64-row block splits into 32 groups of two rows r and r + 8 (one lane
  // group g of one warp); K: every 128-token tile into 4 groups of 32 tokens.
  const auto q = qn::make_group_map(Granularity::PerThread, Operand::Q, 128, 8);
  std::vector<std::vector<int64_t>> q_members(q.count());
  for (int64_t r = 0; r < q.rows; ++r) q_members[q.group_of(r, 0)].push_back(r);
  for (const auto& m : q_members) {
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[1] - m[0], 8);
    EXPECT_EQ(m[0] / 64, m[1] / 64);
    EXPECT_EQ(m[0] / 16, m[1] / 16);  // one warp
    EXPECT_EQ(m[0] % 16, m[0] % 8);   // rows g and g + 8 of the warp
  }
  const auto k = qn::make_group_map(Granularity::PerThread, Operand::K, 256, 8);
  std::vector<std::vector<int64_t>> k_members(k.count());
  for (int64_t r = 0; r < k.rows; ++r) k_members[k.group_of(r, 0)].push_back(r);
  for (const auto& m : k_members) {
    ASSERT_EQ(m.size(), 32u);
    for (int64_t t : m) {
      EXPECT_EQ(t / 128, m[0] / 128);
      EXPECT_EQ((t % 8) / 2, (m[0] % 8) / 2);  // columns 2t, 2t + 1 of each 8-chunk
    }
  }
  // Every group index is in range for every granularity.
  for (Granularity g : kAllGranularities) {
    for (Operand op : kOperands) {
      const auto map = qn::make_group_map(g, op, 300, 24);
      for (int64_t r = 0; r < map.rows; ++r) {
        for (int64_t c = 0; c < map.cols; ++c) {
          const int64_t idx = map.group_of(r, c);
          ASSERT_GE(idx, 0) << name(g, op);
          ASSERT_LT(idx, map.count()) << name(g, op);
        }
      }
    }
  }
}

TEST(GroupMap, ChangingOneElementChangesOnlyItsGroupScale) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 200, cols = 32;
    const auto x = random_matrix(gen, rows, cols);
    std::uniform_int_distribution<int64_t> pick_r(0, rows - 1), pick_c(0, cols - 1);
    for (Granularity g : kAllGranularities) {
      for (Operand op : kOperands) {
        SCOPED_TRACE(name(g, op));
        const int64_t r = pick_r(gen), c = pick_c(gen);
        auto y = x;
        y[r * cols + c] = 100.0f;  // larger than any Gaussian entry: a new amax
        const auto a = qn::quantize_int(x, rows, cols, qn::IntFormat::Int8, g, op);
        const auto b = qn::quantize_int(y, rows, cols, qn::IntFormat::Int8, g, op);
        const int64_t changed = a.groups.group_of(r, c);
        for (int64_t i = 0; i < a.groups.count(); ++i) {
          if (i == changed) {
            EXPECT_EQ(b.scales[i], 100.0f / 127.0f);
          } else {
            EXPECT_EQ(a.scales[i], b.scales[i]) << "group " << i;
          }
        }
      }
    }
  });
}

// ---- INT8 / INT4 -----------------------------------------------------------------------------

TEST(QuantizeInt, ErrorBoundAndScaleRule) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 300, cols = 64;
    const auto x = random_matrix(gen, rows, cols);
    for (qn::IntFormat f : {qn::IntFormat::Int8, qn::IntFormat::Int4}) {
      const float qmax = qn::format_max(f);
      for (Granularity g : kAllGranularities) {
        for (Operand op : kOperands) {
          SCOPED_TRACE(name(g, op) + (f == qn::IntFormat::Int8 ? " int8" : " int4"));
          const auto q = qn::quantize_int(x, rows, cols, f, g, op);
          const auto amax = reference_amax(x, q.groups);
          ASSERT_EQ(q.scales.size(), amax.size());
          std::vector<int> group_peak(amax.size(), 0);
          for (size_t i = 0; i < amax.size(); ++i) EXPECT_EQ(q.scales[i], amax[i] / qmax);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) {
              const int64_t i = r * cols + c;
              const int64_t grp = q.groups.group_of(r, c);
              const float s = q.scales[grp];
              ASSERT_LE(std::abs(q.values[i]), qmax);
              group_peak[grp] = std::max(group_peak[grp], std::abs(int(q.values[i])));
              // Rounding to integers: half a step; x·(qmax/amax) carries ~2 ulp.
              ASSERT_LE(std::fabs(x[i] - q.dequantized[i]), s / 2 + 4 * kEps * amax[grp])
                  << "r " << r << " c " << c;
              ASSERT_EQ(q.dequantized[i], q.values[i] * s);
            }
          }
          for (size_t i = 0; i < amax.size(); ++i) {
            if (amax[i] > 0) {
              EXPECT_EQ(group_peak[i], qmax) << "group " << i;
            }
          }
          EXPECT_EQ(qn::dequantize(q), q.dequantized);
        }
      }
    }
  });
}

TEST(QuantizeInt, KernelArithmeticOfDocs) {
  // docs/sage2-kernel-arithmetic.md §2: scale = amax / 127.f, values rne(x·(127.f/amax)).
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 128, cols = 16;
    const auto x = random_matrix(gen, rows, cols);
    const auto q =
        qn::quantize_int(x, rows, cols, qn::IntFormat::Int8, Granularity::PerThread, Operand::K);
    const auto amax = reference_amax(x, q.groups);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float a = amax[q.groups.group_of(i / cols, i % cols)];
      const float v = std::clamp(std::nearbyint(x[i] * (127.0f / a)), -127.0f, 127.0f);
      ASSERT_EQ(q.values[i], static_cast<int8_t>(v));
    }
  });
}

TEST(QuantizeInt, ZeroGroupsHaveZeroScaleAndValues) {
  const int64_t rows = 256, cols = 8;
  std::vector<float> x(rows * cols, 0.0f);
  for (int64_t c = 0; c < cols; ++c) x[200 * cols + c] = 1.0f + c;  // only tile 1 non-zero
  for (qn::IntFormat f : {qn::IntFormat::Int8, qn::IntFormat::Int4}) {
    const auto q = qn::quantize_int(x, rows, cols, f, Granularity::PerBlock, Operand::K);
    EXPECT_EQ(q.scales[0], 0.0f);
    EXPECT_GT(q.scales[1], 0.0f);
    for (int64_t i = 0; i < 128 * cols; ++i) {
      ASSERT_EQ(q.values[i], 0);
      ASSERT_EQ(q.dequantized[i], 0.0f);
    }
    const auto t =
        qn::quantize_int(std::vector<float>(64, 0.0f), 8, 8, f, Granularity::PerTensor, Operand::Q);
    EXPECT_EQ(t.scales[0], 0.0f);
    for (float v : t.dequantized) EXPECT_EQ(v, 0.0f);
  }
}

TEST(QuantizeInt, NaNAndInfMakeTheirGroupNaN) {
  std::mt19937 gen(7);
  const int64_t rows = 200, cols = 16;
  const auto x = random_matrix(gen, rows, cols);
  for (float bad : {kNaN, kInf, -kInf}) {
    for (Granularity g : kAllGranularities) {
      for (Operand op : kOperands) {
        SCOPED_TRACE(name(g, op) + " bad " + std::to_string(bad));
        auto y = x;
        const int64_t r = 77, c = 5;
        y[r * cols + c] = bad;
        const auto q = qn::quantize_int(y, rows, cols, qn::IntFormat::Int8, g, op);
        const int64_t grp = q.groups.group_of(r, c);
        for (int64_t rr = 0; rr < rows; ++rr) {
          for (int64_t cc = 0; cc < cols; ++cc) {
            const float d = q.dequantized[rr * cols + cc];
            if (q.groups.group_of(rr, cc) == grp) {
              ASSERT_TRUE(std::isnan(d)) << rr << "," << cc;
            } else {
              ASSERT_TRUE(std::isfinite(d)) << rr << "," << cc;
            }
          }
        }
      }
    }
  }
}

// ---- monotonicity of every quantizer (one scale group) ------------------------------------

TEST(Quantize, MonotonicWithinAGroup) {
  for_seeds([](std::mt19937& gen) {
    const int64_t n = 32;  // one row: one NVFP4 pair of blocks, one MXFP4 block
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> x(n);
    for (auto& v : x) v = dist(gen);
    std::sort(x.begin(), x.end());
    auto nondecreasing = [](const std::vector<float>& v) {
      return std::is_sorted(v.begin(), v.end());
    };
    for (qn::IntFormat f : {qn::IntFormat::Int8, qn::IntFormat::Int4}) {
      const auto q = qn::quantize_int(x, 1, n, f, Granularity::PerTensor, Operand::K);
      EXPECT_TRUE(std::is_sorted(q.values.begin(), q.values.end()));
      EXPECT_TRUE(nondecreasing(q.dequantized));
    }
    for (qn::Fp8Format f : {qn::Fp8Format::E4M3, qn::Fp8Format::E5M2}) {
      EXPECT_TRUE(nondecreasing(
          qn::quantize_fp8(x, 1, n, f, Granularity::PerTensor, Operand::K).dequantized));
    }
    EXPECT_TRUE(nondecreasing(qn::quantize_fp4(x, 1, n, qn::Fp4Format::MxFp4).dequantized));
    // NVFP4 blocks are 16 wide: each block separately.
    const auto nv = qn::quantize_fp4(x, 1, n, qn::Fp4Format::NvFp4).dequantized;
    EXPECT_TRUE(std::is_sorted(nv.begin(), nv.begin() + 16));
    EXPECT_TRUE(std::is_sorted(nv.begin() + 16, nv.end()));
  });
}

// ---- FP8 ---------------------------------------------------------------------------------------

TEST(QuantizeFp8, RelativeErrorBound) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 300, cols = 64;
    const auto x = random_matrix(gen, rows, cols);
    struct Case {
      qn::Fp8Format f;
      int mantissa_bits;
      int subnormal_exp;  // log2 of the smallest subnormal
    };
    for (Case k : {Case{qn::Fp8Format::E4M3, 3, -9}, Case{qn::Fp8Format::E5M2, 2, -16}}) {
      for (Granularity g :
           {Granularity::PerTensor, Granularity::PerChannel, Granularity::PerTileChannel}) {
        SCOPED_TRACE(name(g, Operand::K) + " mantissa " + std::to_string(k.mantissa_bits));
        const auto q = qn::quantize_fp8(x, rows, cols, k.f, g, Operand::K);
        const auto amax = reference_amax(x, q.groups);
        for (size_t i = 0; i < amax.size(); ++i) {
          EXPECT_EQ(q.scales[i], amax[i] / qn::format_max(k.f));
        }
        for (int64_t i = 0; i < rows * cols; ++i) {
          const float s = q.scale_at(i / cols, i % cols);
          // Half an ulp relative (RNE), or half the subnormal step, plus the ~2 ulp of
          // the scaling multiply.
          const float bound = std::ldexp(std::fabs(x[i]), -k.mantissa_bits - 1) +
                              s * std::ldexp(1.0f, k.subnormal_exp - 1) +
                              4 * kEps * std::fabs(x[i]);
          ASSERT_LE(std::fabs(x[i] - q.dequantized[i]), bound) << i;
        }
        EXPECT_EQ(qn::dequantize(q), q.dequantized);
      }
    }
  });
}

// The V amax rule of the kernel (docs/sage2-kernel-arithmetic.md step 4).
TEST(SampledAmaxBound, TwiceTheSampleOrTheExactAmax) {
  constexpr int64_t kCols = 4;
  // Up to 256 rows the sample is every row: the exact amax.
  std::vector<float> x(200 * kCols);
  const unsigned seed = qattn::test::fresh_seed32();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (float& e : x) e = u(rng);
  std::vector<float> exact(kCols, 0.f);
  for (int64_t r = 0; r < 200; ++r)
    for (int64_t c = 0; c < kCols; ++c) exact[c] = std::max(exact[c], std::fabs(x[r * kCols + c]));
  EXPECT_EQ(qn::sampled_amax_bound(x, 200, kCols), exact);

  // 1000 rows: rows floor(i·1000/256) are sampled (row 1 is not, row 3 is).
  constexpr int64_t kRows = 1000;
  x.assign(kRows * kCols, 0.f);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) x[r * kCols + c] = 0.5f * u(rng);
  x[3 * kCols + 0] = -1.f;  // channel 0: sampled amax 1, nothing larger: bound 4
  x[3 * kCols + 1] = 1.f;   // channel 1: sampled 1, row 1 holds 4 (= the bound): 4
  x[1 * kCols + 1] = -4.f;
  x[1 * kCols + 2] = 5.f;  // channel 2: row 1 above the bound: its exact amax, 5
  x[1 * kCols + 3] = std::numeric_limits<float>::quiet_NaN();  // channel 3: NaN wins
  const std::vector<float> b = qn::sampled_amax_bound(x, kRows, kCols);
  EXPECT_EQ(b[0], 4.f);
  EXPECT_EQ(b[1], 4.f);
  EXPECT_EQ(b[2], 5.f);
  EXPECT_TRUE(std::isnan(b[3]));

  // A bound past FLT_MAX from a finite amax is FLT_MAX, not inf; an inf stays inf.
  x.assign(kRows * kCols, 0.f);
  x[0] = 1e38f;
  x[1] = std::numeric_limits<float>::infinity();
  const std::vector<float> big = qn::sampled_amax_bound(x, kRows, kCols);
  EXPECT_EQ(big[0], std::numeric_limits<float>::max());
  EXPECT_EQ(big[1], std::numeric_limits<float>::infinity());
  EXPECT_EQ(big[2], 0.f);
}

TEST(QuantizeFp8, GivenAmaxSaturatesAboveIt) {
  const std::vector<float> x = {1.f, -3.f, 0.25f, 2.f};  // 2 rows, 2 channels
  const std::vector<float> amax = {0.5f, 4.f};
  const auto q =
      qn::quantize_fp8(x, 2, 2, qn::Fp8Format::E4M3, Granularity::PerChannel, Operand::K, amax);
  EXPECT_EQ(q.scales[0], 0.5f / 448.f);
  EXPECT_EQ(q.scales[1], 4.f / 448.f);
  EXPECT_EQ(q.codes[0], qn::e4m3_encode(448.f));  // 1 > 0.5: saturates at 448
  EXPECT_EQ(q.codes[1], qn::e4m3_encode(-3.f * 112.f));
  EXPECT_THROW(qn::quantize_fp8(x, 2, 2, qn::Fp8Format::E4M3, Granularity::PerChannel, Operand::K,
                                std::vector<float>{1.f}),
               std::invalid_argument);
}

TEST(QuantizeFp8, ZeroNaNAndSaturation) {
  std::vector<float> x = {0, 0, 0, 0, 1, -2, 3, kNaN};
  const auto q = qn::quantize_fp8(x, 2, 4, qn::Fp8Format::E4M3, Granularity::PerToken, Operand::K);
  EXPECT_EQ(q.scales[0], 0.0f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(q.dequantized[i], 0.0f);
  for (int i = 4; i < 8; ++i) EXPECT_TRUE(std::isnan(q.dequantized[i]));
  // The amax element maps onto the format max exactly.
  const auto p = qn::quantize_fp8(std::vector<float>{1.0f, -3.0f}, 1, 2, qn::Fp8Format::E4M3,
                                  Granularity::PerTensor, Operand::K);
  EXPECT_EQ(qn::e4m3_decode(p.codes[1]), -448.0f);
  EXPECT_EQ(p.dequantized[1], -3.0f);
}

// ---- NVFP4 / MXFP4 -----------------------------------------------------------------------------

TEST(QuantizeFp4, NvFp4ScaleRuleAndBound) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 40, cols = 128;
    const auto x = random_matrix(gen, rows, cols);
    const auto q = qn::quantize_fp4(x, rows, cols, qn::Fp4Format::NvFp4);
    ASSERT_EQ(q.block, 16);
    ASSERT_EQ(q.scales.size(), static_cast<size_t>(rows * cols / 16));
    for (int64_t b = 0; b < rows * cols / 16; ++b) {
      float amax = 0;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[b * 16 + i]));
      EXPECT_EQ(q.scale_codes[b], qn::e4m3_encode(amax / 6.0f));
      EXPECT_EQ(q.scales[b], qn::e4m3_round(amax / 6.0f));
      const float s = q.scales[b];
      for (int i = 0; i < 16; ++i) {
        const int64_t k = b * 16 + i;
        ASSERT_EQ(q.dequantized[k], qn::e2m1_decode(q.codes[k]) * s);
        ASSERT_LT(q.codes[k], 16);
        // The widest E2M1 step is 2 (between 4 and 6): half of it is 1·s. When the
        // E4M3 rounding of amax/6 lowered s, x/s ≤ 6·(1 + 2^-4) saturates to 6 with an
        // error below 0.4·s. Slack for the x/s division.
        ASSERT_LE(std::fabs(x[k] - q.dequantized[k]), s * (1 + 8 * kEps)) << k;
      }
    }
    EXPECT_EQ(qn::dequantize(q), q.dequantized);
  });
}

TEST(QuantizeFp4, MxFp4ScaleRuleAndBound) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 40, cols = 128;
    const auto x = random_matrix(gen, rows, cols);
    const auto q = qn::quantize_fp4(x, rows, cols, qn::Fp4Format::MxFp4);
    ASSERT_EQ(q.block, 32);
    for (int64_t b = 0; b < rows * cols / 32; ++b) {
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
      const int e = static_cast<int>(std::floor(std::log2(amax))) - 2;
      EXPECT_EQ(q.scales[b], std::ldexp(1.0f, e));
      EXPECT_EQ(q.scale_codes[b], e + 127);
      const float s = q.scales[b];
      for (int i = 0; i < 32; ++i) {
        const int64_t k = b * 32 + i;
        // x/s < 8: rounding costs at most 1·s (half the 4..6 step), saturation of
        // (6, 8) to 6 at most 2·s.
        ASSERT_LE(std::fabs(x[k] - q.dequantized[k]), 2 * s) << k;
        if (std::fabs(x[k]) / s > 6) {
          ASSERT_EQ(std::fabs(q.dequantized[k]), 6 * s);
        }
      }
    }
    EXPECT_EQ(qn::dequantize(q), q.dequantized);
  });
}

TEST(QuantizeFp4, ZeroTinyNaNAndInfBlocks) {
  for (qn::Fp4Format f : {qn::Fp4Format::NvFp4, qn::Fp4Format::MxFp4}) {
    const int block = qn::block_size(f);
    std::vector<float> x(4 * block, 0.0f);
    for (int i = 0; i < block; ++i) {
      x[block + i] = 1e-5f * (i + 1);  // NVFP4: amax/6 below half the E4M3 subnormal step
      x[2 * block + i] = 0.25f * i;
      x[3 * block + i] = 0.25f * i;
    }
    x[2 * block + 3] = kNaN;
    x[3 * block + 5] = kInf;
    const auto q = qn::quantize_fp4(x, 1, 4 * block, f);
    for (int i = 0; i < block; ++i) {
      EXPECT_EQ(q.dequantized[i], 0.0f);
      EXPECT_TRUE(std::isnan(q.dequantized[2 * block + i])) << i;
      EXPECT_TRUE(std::isnan(q.dequantized[3 * block + i])) << i;
      if (f == qn::Fp4Format::NvFp4) {
        EXPECT_EQ(q.dequantized[block + i], 0.0f);  // scale rounds to 0: values 0
      } else {
        EXPECT_NEAR(q.dequantized[block + i], x[block + i], 2 * q.scales[1]);
      }
    }
    if (f == qn::Fp4Format::NvFp4) {
      EXPECT_EQ(q.scales[0], 0.0f);
      EXPECT_EQ(q.scales[1], 0.0f);
    } else {
      EXPECT_EQ(q.scale_codes[0], 0);  // 2^-127 with zero elements
      EXPECT_EQ(q.scale_codes[2], qn::kE8M0NaN);
    }
  }
}

// ---- P ------------------------------------------------------------------------------------------

TEST(QuantizeP, TwoLevelFollowsTheDefinition) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 64, cols = 128;
    const auto p = random_probs(gen, rows, cols, 2.0f);
    const auto t = qn::quantize_p_two_level(p, rows, cols);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(t.row_scales[r], 1.0f / (448.0f * 6.0f));  // rowmax of softmax rows is 1
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        const float p2 = p[i] / t.row_scales[r];
        ASSERT_EQ(t.dequantized[i], t.p2.dequantized[i] * t.row_scales[r]);
        ASSERT_LE(std::fabs(p2 - t.p2.dequantized[i]), t.p2.scale_at(r, c) * (1 + 8 * kEps));
      }
    }
    // The same with the rowmax handed in (as the online softmax does).
    const std::vector<float> ones(rows, 1.0f);
    EXPECT_EQ(qn::quantize_p_two_level(p, rows, cols, ones).dequantized, t.dequantized);
  });
}

TEST(QuantizeP, TwoLevelUsesMoreDistinctValuesThanDirect) {
  // Direct NVFP4 of P ≤ 1 puts block scales E4M3(amax/6) on the E4M3 values up to
  // E4M3(1/6) = 0.171875: the 35 values in [0, 1/6] and that one. Two-level spreads
  // them over the whole E4M3 range (SageAttention3 §3).
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 64, cols = 128;
    const auto p = random_probs(gen, rows, cols, 3.0f);
    const auto d = qn::quantize_p_direct(p, rows, cols);
    const auto t = qn::quantize_p_two_level(p, rows, cols);
    std::set<uint8_t> direct_scales(d.scale_codes.begin(), d.scale_codes.end());
    std::set<uint8_t> two_level_scales(t.p2.scale_codes.begin(), t.p2.scale_codes.end());
    EXPECT_LE(direct_scales.size(), 36u);
    EXPECT_LE(*direct_scales.rbegin(), qn::e4m3_encode(1.0f / 6.0f));
    EXPECT_GT(two_level_scales.size(), direct_scales.size());
    double err_direct = 0, err_two = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      err_direct += std::fabs(p[i] - d.dequantized[i]);
      err_two += std::fabs(p[i] - t.dequantized[i]);
    }
    EXPECT_LE(err_two, err_direct);
  });
}

TEST(QuantizeP, ZeroRowsAndNaN) {
  std::vector<float> p(2 * 16, 0.0f);
  for (int c = 0; c < 16; ++c) p[16 + c] = 1.0f / (c + 1);
  auto t = qn::quantize_p_two_level(p, 2, 16);
  EXPECT_EQ(t.row_scales[0], 0.0f);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(t.dequantized[c], 0.0f);
  p[16 + 4] = kNaN;
  t = qn::quantize_p_two_level(p, 2, 16);
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(t.dequantized[c], 0.0f);
    EXPECT_TRUE(std::isnan(t.dequantized[16 + c]));
  }
  const auto s = qn::quantize_p_per_token_int8(p, 2, 16, std::vector<float>{0.0f, 1.0f});
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(s.dequantized[c], 0.0f);
    EXPECT_TRUE(std::isnan(s.dequantized[16 + c]));  // NaN visible despite the given rowmax
  }
}

TEST(QuantizeP, SageBwdPerTokenInt8) {
  for_seeds([](std::mt19937& gen) {
    const int64_t rows = 32, cols = 128;
    const auto p = random_probs(gen, rows, cols, 1.5f);
    const auto q = qn::quantize_p_per_token_int8(p, rows, cols);
    EXPECT_EQ(q.groups.granularity, Granularity::PerToken);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(q.scales[r], 1.0f / 127.0f);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        ASSERT_GE(q.values[i], 0);
        ASSERT_LE(std::fabs(p[i] - q.dequantized[i]), q.scales[r] / 2 + 4 * kEps);
      }
    }
    const std::vector<float> ones(rows, 1.0f);
    EXPECT_EQ(qn::quantize_p_per_token_int8(p, rows, cols, ones).values, q.values);
  });
}

// ---- smoothing
// -------------------------------------------------------------------------------------

TEST(Smoothing, KMeanAndAnyVectorKeepScoresUpToARowConstant) {
  for_seeds([](std::mt19937& gen) {
    const int64_t nq = 20, nk = 300, d = 16;
    const auto q = random_matrix(gen, nq, d);
    const auto k = random_matrix(gen, nk, d, 5.0f);
    const auto sk = qn::smooth_k(k, nk, d);
    ASSERT_EQ(sk.means.size(), static_cast<size_t>(d));
    for (int64_t c = 0; c < d; ++c) {
      double m = 0;
      for (int64_t j = 0; j < nk; ++j) m += sk.values[j * d + c];
      EXPECT_NEAR(m / nk, 0.0, 1e-5);
    }
    // S_smoothed[i][j] + q_i·c = S[i][j]: the shift is constant along each row.
    const auto qc = qn::dot_rows(q, nq, d, sk.means);
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double s = 0, ss = 0;
        for (int64_t c = 0; c < d; ++c) {
          s += double(q[i * d + c]) * k[j * d + c];
          ss += double(q[i * d + c]) * sk.values[j * d + c];
        }
        ASSERT_NEAR(ss + qc[i], s, 1e-3 * (1 + std::fabs(s)));
      }
    }
    // Any vector: K − c exactly.
    std::vector<float> c(d);
    std::iota(c.begin(), c.end(), -3.0f);
    const auto kc = qn::smooth_k_with(k, nk, d, c);
    for (int64_t i = 0; i < nk * d; ++i) ASSERT_EQ(kc.values[i], k[i] - c[i % d]);
  });
}

TEST(Smoothing, SampledMeanUsesTheDocumentedTokens) {
  std::mt19937 gen(3);
  const int64_t d = 8;
  const auto small = random_matrix(gen, 200, d);
  EXPECT_EQ(qn::token_mean(small, 200, d, qn::MeanEstimate::Sampled),
            qn::token_mean(small, 200, d, qn::MeanEstimate::AllTokens));
  const int64_t n = 1000;
  const auto k = random_matrix(gen, n, d);
  const auto got = qn::token_mean(k, n, d, qn::MeanEstimate::Sampled);
  for (int64_t c = 0; c < d; ++c) {
    double s = 0;
    for (int64_t i = 0; i < 256; ++i) s += k[(i * n / 256) * d + c];
    EXPECT_EQ(got[c], static_cast<float>(s / 256));
  }
}

TEST(Smoothing, QBlockMeansAndCorrectionRestoreScores) {
  for_seeds([](std::mt19937& gen) {
    const int64_t nq = 150, nk = 40, d = 16;  // 3 Q blocks, the last one short
    const auto q = random_matrix(gen, nq, d, 4.0f);
    const auto k = random_matrix(gen, nk, d);
    const auto sq = qn::smooth_q(q, nq, d);
    ASSERT_EQ(sq.mean_rows, 3);
    ASSERT_EQ(sq.rows_per_mean, 64);
    const auto corr = qn::q_mean_scores(sq, k, nk, d);
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t b = i / 64;
      for (int64_t j = 0; j < nk; ++j) {
        double s = 0, ss = 0;
        for (int64_t c = 0; c < d; ++c) {
          s += double(q[i * d + c]) * k[j * d + c];
          ss += double(sq.values[i * d + c]) * k[j * d + c];
        }
        ASSERT_NEAR(ss + corr[b * nk + j], s, 1e-4 * (1 + std::fabs(s)));
      }
    }
    // Block means of the smoothed Q are 0.
    for (int64_t b = 0; b < 3; ++b) {
      const int64_t n = std::min<int64_t>(64, nq - b * 64);
      for (int64_t c = 0; c < d; ++c) {
        double m = 0;
        for (int64_t i = b * 64; i < b * 64 + n; ++i) m += sq.values[i * d + c];
        EXPECT_NEAR(m / n, 0.0, 1e-5);
      }
    }
  });
}

TEST(Smoothing, VMeanAddedBackAndNaN) {
  std::mt19937 gen(5);
  const int64_t n = 50, d = 8;
  auto v = random_matrix(gen, n, d);
  const auto sv = qn::smooth_v(v, n, d);
  const auto back = qn::add_row_vector(sv.values, n, d, sv.means);
  for (int64_t i = 0; i < n * d; ++i) EXPECT_NEAR(back[i], v[i], 1e-5f * (1 + std::fabs(v[i])));
  v[3 * d + 2] = kNaN;  // one NaN poisons its channel's mean and so the whole channel
  const auto bad = qn::smooth_v(v, n, d);
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_TRUE(std::isnan(bad.values[r * d + 2]));
    EXPECT_FALSE(std::isnan(bad.values[r * d + 1]));
  }
}

// ---- bad sizes
// --------------------------------------------------------------------------------------

namespace {
// Expects std::invalid_argument whose message names `param`.
template <typename F>
void expect_invalid(F&& f, const std::string& param) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one naming " << param;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(param), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(QuantizeValidation, BadSizesThrowNamingTheParameter) {
  const std::vector<float> x(12, 1.0f);
  using qn::IntFormat;
  expect_invalid(
      [&] { qn::quantize_int(x, 0, 12, IntFormat::Int8, Granularity::PerTensor, Operand::Q); },
      "rows");
  expect_invalid(
      [&] { qn::quantize_int(x, 3, -4, IntFormat::Int8, Granularity::PerTensor, Operand::Q); },
      "cols");
  expect_invalid(
      [&] { qn::quantize_int(x, 3, 5, IntFormat::Int8, Granularity::PerTensor, Operand::Q); },
      "x.size()");
  expect_invalid(
      [&] {
        qn::quantize_int(x, 3, 4, static_cast<IntFormat>(9), Granularity::PerTensor, Operand::Q);
      },
      "format");
  expect_invalid(
      [&] { qn::quantize_int(x, 3, 4, IntFormat::Int8, static_cast<Granularity>(42), Operand::Q); },
      "granularity");
  expect_invalid(
      [&] {
        qn::quantize_int(x, 3, 4, IntFormat::Int8, Granularity::PerThread, static_cast<Operand>(5));
      },
      "operand");
  expect_invalid(
      [&] { qn::quantize_fp8(x, 4, 4, qn::Fp8Format::E4M3, Granularity::PerTensor, Operand::K); },
      "x.size()");
  expect_invalid([&] { qn::quantize_fp4(x, 1, 12, qn::Fp4Format::NvFp4); }, "cols");
  expect_invalid([&] { qn::quantize_fp4(std::vector<float>(48), 3, 16, qn::Fp4Format::MxFp4); },
                 "cols");
  expect_invalid(
      [&] { qn::quantize_p_two_level(std::vector<float>(32), 2, 16, std::vector<float>(3)); },
      "rowmax");
  expect_invalid([&] { qn::quantize_p_per_token_int8(x, 2, 6, std::vector<float>(1)); }, "rowmax");
  expect_invalid([&] { qn::quantize_p_direct(x, 2, 5); }, "p.size()");
  expect_invalid([&] { qn::smooth_k_with(x, 3, 4, std::vector<float>(3)); }, "c.size()");
  expect_invalid([&] { qn::smooth_q(x, 3, 4, 0); }, "block_rows");
  expect_invalid([&] { qn::token_mean(x, 3, 4, static_cast<qn::MeanEstimate>(7)); }, "estimate");
  expect_invalid([&] { qn::dot_rows(x, 3, 4, std::vector<float>(5)); }, "v.size()");
  expect_invalid([&] { qn::q_mean_scores(qn::smooth_q(x, 3, 4), x, 4, 4); }, "k.size()");
  expect_invalid([&] { qn::make_group_map(Granularity::PerToken, Operand::K, 1, 0); }, "cols");
}
