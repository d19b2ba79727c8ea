// Number formats: exhaustive over every code, plus random floats checked against an
// independent oracle (nearest representable value found by search in double).
#include <gtest/gtest.h>

#include "test_seed.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "numerics/formats.h"

namespace qn = qattn::numerics;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kRandomSamples = 200000;

using EncodeFn = uint8_t (*)(float);
using DecodeFn = float (*)(uint8_t);

struct Fp8Like {
  const char* name;
  EncodeFn encode;
  DecodeFn decode;
  int codes;  // 256 for 8-bit formats, 16 for E2M1
  uint8_t sign_bit;
  float max;
};

const Fp8Like kE4M3{"e4m3", qn::e4m3_encode, qn::e4m3_decode, 256, 0x80, 448.0f};
const Fp8Like kE5M2{"e5m2", qn::e5m2_encode, qn::e5m2_decode, 256, 0x80, 57344.0f};
const Fp8Like kE2M1{"e2m1", qn::e2m1_encode, qn::e2m1_decode, 16, 0x8, 6.0f};

// The non-negative finite codes of a format, in increasing order of value.
std::vector<uint8_t> nonneg_finite_codes(const Fp8Like& f) {
  std::vector<uint8_t> out;
  for (int c = 0; c < f.codes; ++c) {
    if (c & f.sign_bit) continue;
    const float v = f.decode(static_cast<uint8_t>(c));
    if (std::isfinite(v)) out.push_back(static_cast<uint8_t>(c));
  }
  return out;
}

// Independent oracle: nearest finite value, ties to the even code, saturating.
uint8_t oracle_encode(const Fp8Like& f, const std::vector<uint8_t>& codes, float x) {
  const double a = std::fabs(static_cast<double>(x));
  uint8_t best = codes.front();
  double best_err = std::numeric_limits<double>::infinity();
  for (uint8_t c : codes) {
    const double err = std::fabs(static_cast<double>(f.decode(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  if (std::isinf(a)) best = codes.back();
  return std::signbit(x) ? static_cast<uint8_t>(best | f.sign_bit) : best;
}

// A random float whose magnitude spans the format's range (random exponent and bits).
float random_float(std::mt19937& gen, int min_exp, int max_exp) {
  std::uniform_int_distribution<int> e(min_exp, max_exp);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::bernoulli_distribution neg(0.5);
  const float v = std::ldexp(m(gen), e(gen));
  return neg(gen) ? -v : v;
}

unsigned fresh_seed() { return qattn::test::fresh_seed32(); }

void check_exhaustive(const Fp8Like& f) {
  SCOPED_TRACE(f.name);
  for (int c = 0; c < f.codes; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = f.decode(code);
    if (std::isnan(v) || std::isinf(v)) continue;
    EXPECT_EQ(f.encode(v), code) << "code " << c << " value " << v;
    EXPECT_EQ(std::signbit(v), (code & f.sign_bit) != 0) << "code " << c;
  }
  // Strictly increasing over the non-negative finite codes; negation mirrors them.
  const auto codes = nonneg_finite_codes(f);
  for (size_t i = 1; i < codes.size(); ++i) {
    EXPECT_EQ(codes[i], codes[i - 1] + 1);
    EXPECT_LT(f.decode(codes[i - 1]), f.decode(codes[i])) << "code " << int(codes[i]);
  }
  for (uint8_t c : codes) EXPECT_EQ(f.decode(c | f.sign_bit), -f.decode(c));
  EXPECT_EQ(f.decode(codes.back()), f.max);
}

// Midpoints between neighbouring codes go to the even code; one ulp off goes to the
// nearer side.
void check_ties(const Fp8Like& f) {
  SCOPED_TRACE(f.name);
  const auto codes = nonneg_finite_codes(f);
  for (size_t i = 0; i + 1 < codes.size(); ++i) {
    const float lo = f.decode(codes[i]), hi = f.decode(codes[i + 1]);
    const float mid = lo + (hi - lo) / 2;  // exact: few mantissa bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const uint8_t even = (codes[i] & 1) == 0 ? codes[i] : codes[i + 1];
    EXPECT_EQ(f.encode(mid), even) << lo << ".." << hi;
    EXPECT_EQ(f.encode(-mid), even | f.sign_bit) << lo << ".." << hi;
    EXPECT_EQ(f.encode(std::nextafter(mid, 0.0f)), codes[i]) << lo << ".." << hi;
    EXPECT_EQ(f.encode(std::nextafter(mid, kInf)), codes[i + 1]) << lo << ".." << hi;
  }
}

void check_saturation(const Fp8Like& f) {
  SCOPED_TRACE(f.name);
  const uint8_t max_code = nonneg_finite_codes(f).back();
  for (float x : {f.max, f.max * 1.03f, f.max * 1.2f, f.max * 1000.0f, 3.0e38f, kInf}) {
    EXPECT_EQ(f.encode(x), max_code) << x;
    EXPECT_EQ(f.encode(-x), max_code | f.sign_bit) << x;
  }
}

void check_random_against_oracle(const Fp8Like& f, int min_exp, int max_exp) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << f.name << " " << qattn::test::seed_trace(seed));
  std::mt19937 gen(seed);
  const auto codes = nonneg_finite_codes(f);
  int failures = 0;
  for (int i = 0; i < kRandomSamples / 10 && failures < 10; ++i) {
    const float x = random_float(gen, min_exp, max_exp);
    const uint8_t want = oracle_encode(f, codes, x);
    if (f.encode(x) != want) {
      ++failures;
      ADD_FAILURE() << "x=" << x << " got " << int(f.encode(x)) << " want " << int(want);
    }
  }
}

}  // namespace

// ---- E4M3 --------------------------------------------------------------------------

TEST(E4M3, ExhaustiveRoundTripAndMonotonic) { check_exhaustive(kE4M3); }
TEST(E4M3, TiesToEvenAtEveryMidpoint) { check_ties(kE4M3); }
TEST(E4M3, SaturatesToMaxFinite) { check_saturation(kE4M3); }
TEST(E4M3, RandomFloatsMatchOracle) { check_random_against_oracle(kE4M3, -12, 10); }

TEST(E4M3, PinnedFacts) {
  std::set<float> values;
  for (int c = 0; c < 256; ++c) {
    const float v = qn::e4m3_decode(static_cast<uint8_t>(c));
    if (std::isfinite(v) && v >= 0.0f) values.insert(v);  // +0 and -0 are one value
  }
  EXPECT_EQ(values.size(), 127u);
  EXPECT_EQ(*values.rbegin(), 448.0f);
  const auto le_sixth =
      std::count_if(values.begin(), values.end(), [](float v) { return v <= 1.0f / 6.0f; });
  EXPECT_EQ(le_sixth, 35);
  EXPECT_EQ(qn::e4m3_decode(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(qn::e4m3_decode(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(E4M3, NaN) {
  EXPECT_TRUE(std::isnan(qn::e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(qn::e4m3_decode(0xFF)));
  EXPECT_EQ(qn::e4m3_encode(kNaN), qn::kE4M3NaN);
  EXPECT_EQ(qn::e4m3_encode(-kNaN), qn::kE4M3NaN);
  EXPECT_TRUE(std::isnan(qn::e4m3_round(kNaN)));
  int nan_codes = 0;
  for (int c = 0; c < 256; ++c) nan_codes += std::isnan(qn::e4m3_decode(static_cast<uint8_t>(c)));
  EXPECT_EQ(nan_codes, 2);
}

TEST(E4M3, SubnormalRounding) {
  const float q = std::ldexp(1.0f, -9);
  EXPECT_EQ(qn::e4m3_encode(q / 2), 0x00);  // tie between 0 and 2^-9 -> 0 (even)
  EXPECT_EQ(qn::e4m3_encode(std::nextafter(q / 2, 1.0f)), 0x01);
  EXPECT_EQ(qn::e4m3_encode(1.5f * q), 0x02);  // tie 1 vs 2 -> 2
  EXPECT_EQ(qn::e4m3_encode(2.5f * q), 0x02);  // tie 2 vs 3 -> 2
  EXPECT_EQ(qn::e4m3_encode(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(qn::e4m3_encode(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(qn::e4m3_encode(7.5f * q), 0x08);  // tie 7 vs 8 (carry into the normals)
}

TEST(E4M3, RoundIsDecodeOfEncode) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 gen(seed);
  for (int i = 0; i < kRandomSamples; ++i) {
    const float x = random_float(gen, -14, 12);
    ASSERT_EQ(qn::e4m3_round(x), qn::e4m3_decode(qn::e4m3_encode(x))) << x;
    // Relative error of a normal-range value is at most 2^-4 (3 mantissa bits, RNE).
    if (std::fabs(x) >= std::ldexp(1.0f, -6) && std::fabs(x) <= 448.0f) {
      ASSERT_LE(std::fabs(qn::e4m3_round(x) - x), std::ldexp(std::fabs(x), -4)) << x;
    }
  }
}

// ---- E5M2 --------------------------------------------------------------------------

TEST(E5M2, ExhaustiveRoundTripAndMonotonic) { check_exhaustive(kE5M2); }
TEST(E5M2, TiesToEvenAtEveryMidpoint) { check_ties(kE5M2); }
TEST(E5M2, SaturatesToMaxFinite) { check_saturation(kE5M2); }
TEST(E5M2, RandomFloatsMatchOracle) { check_random_against_oracle(kE5M2, -20, 18); }

TEST(E5M2, InfAndNaNCodes) {
  EXPECT_EQ(qn::e5m2_decode(0x7C), kInf);
  EXPECT_EQ(qn::e5m2_decode(0xFC), -kInf);
  for (uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
    EXPECT_TRUE(std::isnan(qn::e5m2_decode(c))) << int(c);
  }
  EXPECT_EQ(qn::e5m2_encode(kNaN), qn::kE5M2NaN);
  EXPECT_TRUE(std::isnan(qn::e5m2_round(kNaN)));
  EXPECT_EQ(qn::e5m2_decode(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(qn::e5m2_decode(0x7B), 57344.0f);
  std::set<float> values;
  for (int c = 0; c < 256; ++c) {
    const float v = qn::e5m2_decode(static_cast<uint8_t>(c));
    if (std::isfinite(v) && v >= 0.0f) values.insert(v);
  }
  EXPECT_EQ(values.size(), 124u);  // 31 finite exponent fields x 4 mantissas
}

// ---- E2M1 --------------------------------------------------------------------------

TEST(E2M1, ExhaustiveRoundTripAndMonotonic) { check_exhaustive(kE2M1); }
TEST(E2M1, TiesToEvenAtEveryMidpoint) { check_ties(kE2M1); }
TEST(E2M1, SaturatesToMaxFinite) { check_saturation(kE2M1); }
TEST(E2M1, RandomFloatsMatchOracle) { check_random_against_oracle(kE2M1, -4, 4); }

TEST(E2M1, EightMagnitudes) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(qn::e2m1_decode(static_cast<uint8_t>(c)), expected[c]) << c;
    EXPECT_EQ(qn::e2m1_decode(static_cast<uint8_t>(c | 0x8)), -expected[c]) << c;
  }
  EXPECT_TRUE(std::signbit(qn::e2m1_decode(0x8)));
  EXPECT_EQ(qn::e2m1_decode(0xF3), 1.5f);  // only the low nibble is read
}

TEST(E2M1, NaNPolicy) {
  EXPECT_EQ(qn::e2m1_encode(kNaN), 0);  // no NaN code: +0, the block scale carries NaN
  EXPECT_TRUE(std::isnan(qn::e2m1_round(kNaN)));
  EXPECT_EQ(qn::e2m1_encode(5.0f), 0x6);  // tie 4 vs 6 -> 4 (even code)
  EXPECT_EQ(qn::e2m1_encode(2.5f), 0x4);  // tie 2 vs 3 -> 2
  EXPECT_EQ(qn::e2m1_encode(0.25f), 0x0);
  EXPECT_EQ(qn::e2m1_encode(0.75f), 0x2);
}

// ---- E8M0 --------------------------------------------------------------------------

TEST(E8M0, AllCodes) {
  for (int c = 0; c < 255; ++c) {
    const float v = qn::e8m0_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(v, std::ldexp(1.0f, c - 127)) << c;
    EXPECT_EQ(qn::e8m0_encode_exponent(c - 127), c);
    if (c > 0) EXPECT_EQ(v, 2.0f * qn::e8m0_decode(static_cast<uint8_t>(c - 1)));
  }
  EXPECT_TRUE(std::isnan(qn::e8m0_decode(0xFF)));
  EXPECT_EQ(qn::e8m0_encode_exponent(200), 0xFE);  // clamps, never NaN
  EXPECT_EQ(qn::e8m0_encode_exponent(-200), 0x00);
  EXPECT_EQ(qn::e8m0_decode(127), 1.0f);
}

// ---- integers ------------------------------------------------------------------------

TEST(Rne, TiesToEvenAndSpecials) {
  EXPECT_EQ(qn::rne(0.5f), 0.0f);
  EXPECT_EQ(qn::rne(1.5f), 2.0f);
  EXPECT_EQ(qn::rne(2.5f), 2.0f);
  EXPECT_EQ(qn::rne(-2.5f), -2.0f);
  EXPECT_EQ(qn::rne(-3.5f), -4.0f);
  EXPECT_EQ(qn::rne(2.4999998f), 2.0f);
  EXPECT_TRUE(std::signbit(qn::rne(-0.3f)));
  EXPECT_EQ(qn::rne(8388607.5f), 8388608.0f);
  EXPECT_EQ(qn::rne(1.0e30f), 1.0e30f);
  EXPECT_EQ(qn::rne(kInf), kInf);
  EXPECT_TRUE(std::isnan(qn::rne(kNaN)));
}

TEST(Rne, MatchesNearbyintInDefaultMode) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-300.0f, 300.0f);
  for (int i = 0; i < kRandomSamples; ++i) {
    const float x = i % 2 ? u(gen) : random_float(gen, -3, 25);
    ASSERT_EQ(qn::rne(x), std::nearbyint(x)) << x;
  }
  for (int k = -1000; k <= 1000; ++k) {
    const float x = static_cast<float>(k) + 0.5f;
    ASSERT_EQ(qn::rne(x), std::nearbyint(x)) << x;
  }
}

TEST(IntQuantize, ClampRoundAndNaN) {
  EXPECT_EQ(qn::int8_quantize(1.0f, 127.0f), 127);
  EXPECT_EQ(qn::int8_quantize(-2.0f, 127.0f), -127);  // clamp, never -128
  EXPECT_EQ(qn::int8_quantize(0.5f, 1.0f), 0);
  EXPECT_EQ(qn::int8_quantize(1.5f, 1.0f), 2);
  EXPECT_EQ(qn::int8_quantize(kNaN, 1.0f), 0);
  EXPECT_EQ(qn::int8_quantize(1.0f, kNaN), 0);
  EXPECT_EQ(qn::int8_quantize(kInf, 1.0f), 127);
  EXPECT_EQ(qn::int8_quantize(-kInf, 1.0f), -127);
  EXPECT_EQ(qn::int4_quantize(1.0f, 7.0f), 7);
  EXPECT_EQ(qn::int4_quantize(-9.0f, 1.0f), -7);
  EXPECT_EQ(qn::int4_quantize(6.5f, 1.0f), 6);
  EXPECT_EQ(qn::int4_quantize(kNaN, 1.0f), 0);
  for (int k = -300; k <= 300; ++k) {
    const float x = static_cast<float>(k) / 2;
    EXPECT_EQ(qn::int8_quantize(x, 1.0f), std::clamp(std::nearbyint(x), -127.0f, 127.0f));
    EXPECT_EQ(qn::int4_quantize(x, 1.0f), std::clamp(std::nearbyint(x), -7.0f, 7.0f));
  }
}

// ---- FP16 / BF16 ---------------------------------------------------------------------

TEST(Fp16, AllCodesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = qn::fp16_from_bits(static_cast<uint16_t>(h));
    if (std::isnan(v)) {
      EXPECT_EQ(h & 0x7C00u, 0x7C00u);
      continue;
    }
    EXPECT_EQ(qn::fp16_bits(v), h) << h;
    EXPECT_EQ(static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(h))), v) << h;
  }
}

TEST(Fp16, RandomFloatsMatchCompilerCast) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 gen(seed);
  for (int i = 0; i < kRandomSamples; ++i) {
    const float x = random_float(gen, -26, 17);
    const uint16_t want = std::bit_cast<uint16_t>(static_cast<_Float16>(x));
    ASSERT_EQ(qn::fp16_bits(x), want) << x;
  }
  EXPECT_EQ(qn::fp16_round(65519.0f), 65504.0f);
  EXPECT_EQ(qn::fp16_round(65520.0f), kInf);  // IEEE cast: overflow to Inf
  EXPECT_TRUE(std::isnan(qn::fp16_round(kNaN)));
}

TEST(Bf16, RoundingAgainstOracle) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(qattn::test::seed_trace(seed));
  std::mt19937 gen(seed);
  for (int i = 0; i < kRandomSamples; ++i) {
    const float x = random_float(gen, -130, 127);
    const float r = qn::bf16_round(x);
    // Oracle: the two bf16 neighbours by truncation, nearest wins, ties to even.
    const uint32_t b = std::bit_cast<uint32_t>(x);
    const float lo = std::bit_cast<float>(b & 0xFFFF0000u);
    const uint32_t hi_bits = (b & 0xFFFF0000u) + 0x10000u;  // may step onto +-Inf
    const float hi = std::bit_cast<float>(hi_bits);
    // Distance to hi in double, where the step past the max finite bf16 is 2^128.
    const int field = std::max(1, static_cast<int>((b >> 23) & 0xFFu));  // subnormals: 1
    const double ulp = std::ldexp(1.0, field - 127 - 7);
    const double dl = std::fabs(static_cast<double>(x) - lo);
    const double dh = ulp - dl;
    const float want = dl < dh ? lo : (dh < dl ? hi : (((b >> 16) & 1u) ? hi : lo));
    ASSERT_EQ(r, want) << x;
  }
  EXPECT_EQ(qn::bf16_round(1.0f + std::ldexp(1.0f, -8)), 1.0f);  // tie -> even
  EXPECT_EQ(qn::bf16_round(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(qn::bf16_round(kNaN)));
  EXPECT_EQ(qn::bf16_round(kInf), kInf);
  EXPECT_EQ(qn::bf16_round(std::numeric_limits<float>::max()), kInf);
}
