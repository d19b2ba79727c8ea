// Number formats of qattn: E4M3, E5M2, E2M1, E8M0, INT8, INT4, and the 16-bit
// operand formats FP16 and BF16. Host and device (QATTN_HD), no lookup tables.
//
// Encoding rounds to nearest, ties to even, and saturates finite overflow to the
// largest finite value (docs/design.md, Numerics). It is computed with integer bit operations
// and exact float scaling by powers of two, so it does not depend on the FP
// environment (rounding mode, fast-math contraction) of the caller.
//
// Per format:
//   E4M3 (OCP FP8): bias 7, 3 mantissa bits, subnormal step 2^-9, max 448, no Inf,
//     NaN codes 0x7F/0xFF. encode(±Inf) = ±448 and encode(NaN) = 0x7F, meant to
//     equal the GPU's cvt.rn.satfinite.e4m3x2.f32 bit for bit. Finite inputs follow
//     the OCP rules exactly; on the H200 the kernel's E4M3 V codes equalled
//     e4m3_encode on every tested value (tests/gpu, MatchesEmulation*). The NaN code
//     0x7F is assumed, not checked on a GPU.
//   E5M2 (OCP FP8): bias 15, 2 mantissa bits, subnormal step 2^-16, max 57344,
//     Inf codes 0x7C/0xFC (decoded as ±Inf), NaN 0x7D..0x7F/0xFD..0xFF.
//     encode(±Inf) = ±57344 (satfinite), encode(NaN) = 0x7F.
//   E2M1 (OCP FP4): 4-bit code in the low nibble, bit 3 the sign, magnitudes
//     {0, 0.5, 1, 1.5, 2, 3, 4, 6}; saturates at ±6 (±Inf too). There is no NaN
//     code: e2m1_encode(NaN) returns 0 (+0), so a block quantizer must carry the
//     NaN in its block scale (it does: amax becomes NaN, the scale NaN, and every
//     dequantized value of the block NaN). e2m1_round(NaN) returns NaN.
//   E8M0 (OCP MX scale): unsigned exponent byte, value 2^(code - 127), 0xFF = NaN.
//   INT8/INT4: clamp(rne(x * inv_scale), ±127 / ±7). A NaN product gives 0, as the
//     GPU's cvt.rni.sat.s8.f32; the block scale (amax/127, NaN when the block holds
//     a NaN) is what keeps the NaN visible.
//   FP16/BF16: IEEE-style casts (RNE, overflow to Inf, NaN stays NaN), for
//     modelling 16-bit operands; these do not saturate.
#pragma once

#include <cstdint>

#include "numerics/hd.h"

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace qattn::numerics {

// ---- format constants --------------------------------------------------------

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kLog2E4M3Max = 8.807354922057604f;  // log2(kE4M3Max)
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kE2M1Max = 6.0f;
inline constexpr int kInt8Max = 127;
inline constexpr int kInt4Max = 7;
inline constexpr int kE8M0Bias = 127;
inline constexpr uint8_t kE8M0NaN = 0xFF;
inline constexpr uint8_t kE4M3NaN = 0x7F;  // canonical NaN (0xFF is NaN too)
inline constexpr uint8_t kE5M2NaN = 0x7F;
inline constexpr uint8_t kE2M1SignBit = 0x8;

// ---- float bit helpers ----------------------------------------------------------

namespace detail {

inline constexpr uint32_t kF32SignMask = 0x80000000u;
inline constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kF32InfBits = 0x7F800000u;
inline constexpr uint32_t kF32QuietNaN = 0x7FC00000u;
inline constexpr int kF32MantissaBits = 23;
inline constexpr int kF32Bias = 127;
// At and above 2^23 every float is an integer.
inline constexpr float kF32IntegerThreshold = 8388608.0f;

QATTN_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}

QATTN_HD float float_of(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}

QATTN_HD bool is_nan_bits(uint32_t b) { return (b & kF32AbsMask) > kF32InfBits; }

// 2^k for k in [-149, 127], exact (subnormal results included).
QATTN_HD float exp2i(int k) {
  constexpr int kMinNormal = 1 - kF32Bias;
  if (k >= kMinNormal) return float_of(static_cast<uint32_t>(k + kF32Bias) << kF32MantissaBits);
  return float_of(1u << (k - kMinNormal + kF32MantissaBits));
}

// floor(log2(a)) of a finite a > 0 (a float exponent, subnormals included).
QATTN_HD int floor_log2_bits(uint32_t abs_bits) {
  const int field = static_cast<int>(abs_bits >> kF32MantissaBits);
  if (field != 0) return field - kF32Bias;
  int e = 1 - kF32Bias - kF32MantissaBits;  // exponent of the lowest mantissa bit
  for (uint32_t m = abs_bits; m > 1; m >>= 1) ++e;
  return e;
}

// Round half to even of a finite |v| < 2^23 given as float, via integer truncation.
QATTN_HD uint32_t rne_small_nonneg(float v) {
  const uint32_t t = static_cast<uint32_t>(v);   // float->int truncates toward zero
  const float frac = v - static_cast<float>(t);  // exact: the fractional part of v
  if (frac > 0.5f || (frac == 0.5f && (t & 1u))) return t + 1u;
  return t;
}

// The code magnitude (exponent field << kMan | mantissa, no sign) of the nearest
// value, ties to even, of the float format with kMan mantissa bits and exponent
// bias kBias, for a finite a >= 0; not saturated (the caller compares with its max
// code: codes grow monotonically with the value they encode).
template <int kMan, int kBias>
QATTN_HD uint32_t encode_magnitude(float a) {
  constexpr int kEmin = 1 - kBias;  // exponent of the smallest normal
  const uint32_t b = bits_of(a);
  if (b == 0) return 0;
  int e = floor_log2_bits(b);
  if (e < kEmin) e = kEmin;  // subnormal range: fixed quantum 2^(kEmin - kMan)
  // a * 2^(kMan - e) is exact (power-of-two scaling into [0, 2^(kMan+1))).
  const uint32_t n = rne_small_nonneg(a * exp2i(kMan - e));
  // Subnormals give n < 2^kMan with e == kEmin; a carry to n == 2^(kMan+1) rolls
  // into the next exponent field by plain addition.
  return (static_cast<uint32_t>(e - kEmin) << kMan) + n;
}

// The magnitude encoded by a finite code magnitude (see encode_magnitude).
template <int kMan, int kBias>
QATTN_HD float decode_magnitude(uint32_t code) {
  constexpr int kEmin = 1 - kBias;
  const uint32_t field = code >> kMan;
  const uint32_t man = code & ((1u << kMan) - 1u);
  if (field == 0) return static_cast<float>(man) * exp2i(kEmin - kMan);
  return static_cast<float>(man + (1u << kMan)) * exp2i(static_cast<int>(field) - kBias - kMan);
}

}  // namespace detail

// ---- rounding to integers -------------------------------------------------------

// Round half to even, independent of the FP rounding mode. NaN and ±Inf pass
// through; the sign of zero is kept (rne(-0.3f) = -0.0f).
QATTN_HD float rne(float x) {
  const uint32_t b = detail::bits_of(x);
  const float a = detail::float_of(b & detail::kF32AbsMask);
  if (!(a < detail::kF32IntegerThreshold)) return x;  // integer already, Inf or NaN
  const float r = static_cast<float>(detail::rne_small_nonneg(a));
  return detail::float_of(detail::bits_of(r) | (b & detail::kF32SignMask));
}

namespace detail {
// clamp(rne(v), -qmax, qmax); NaN -> 0.
QATTN_HD int8_t clamp_rne(float v, int qmax) {
  if (is_nan_bits(bits_of(v))) return 0;
  const float r = rne(v);
  const float m = static_cast<float>(qmax);
  return static_cast<int8_t>(r > m ? m : (r < -m ? -m : r));
}
}  // namespace detail

// clamp(rne(x * inv_scale), -127, 127); a NaN product gives 0 (see the top comment).
QATTN_HD int8_t int8_quantize(float x, float inv_scale) {
  return detail::clamp_rne(x * inv_scale, kInt8Max);
}

// clamp(rne(x * inv_scale), -7, 7), stored in an int8_t; a NaN product gives 0.
QATTN_HD int8_t int4_quantize(float x, float inv_scale) {
  return detail::clamp_rne(x * inv_scale, kInt4Max);
}

// ---- E4M3 -----------------------------------------------------------------------

namespace detail {
inline constexpr int kE4M3Man = 3;
inline constexpr int kE4M3Bias = 7;
inline constexpr uint32_t kE4M3MaxCode = 0x7E;
inline constexpr int kE5M2Man = 2;
inline constexpr int kE5M2Bias = 15;
inline constexpr uint32_t kE5M2MaxCode = 0x7B;
inline constexpr uint32_t kE5M2InfCode = 0x7C;
inline constexpr int kE2M1Man = 1;
inline constexpr int kE2M1Bias = 1;
inline constexpr uint32_t kE2M1MaxCode = 0x7;
inline constexpr uint8_t kFp8SignBit = 0x80;
inline constexpr uint8_t kFp8AbsMask = 0x7F;

// Encodes with saturation at max_code; NaN -> nan_code. Inf saturates too.
template <int kMan, int kBias>
QATTN_HD uint32_t encode_saturating(float x, uint32_t max_code, uint32_t nan_code,
                                    uint32_t sign_bit) {
  const uint32_t b = bits_of(x);
  if (is_nan_bits(b)) return nan_code;
  const uint32_t sign = (b & kF32SignMask) ? sign_bit : 0u;
  const uint32_t abs_b = b & kF32AbsMask;
  if (abs_b == kF32InfBits) return sign | max_code;
  const uint32_t m = encode_magnitude<kMan, kBias>(float_of(abs_b));
  return sign | (m > max_code ? max_code : m);
}
}  // namespace detail

QATTN_HD uint8_t e4m3_encode(float x) {
  return static_cast<uint8_t>(detail::encode_saturating<detail::kE4M3Man, detail::kE4M3Bias>(
      x, detail::kE4M3MaxCode, kE4M3NaN, detail::kFp8SignBit));
}

QATTN_HD float e4m3_decode(uint8_t code) {
  const uint32_t m = code & detail::kFp8AbsMask;
  if (m == kE4M3NaN) return detail::float_of(detail::kF32QuietNaN);
  const float v = detail::decode_magnitude<detail::kE4M3Man, detail::kE4M3Bias>(m);
  return (code & detail::kFp8SignBit) ? -v : v;
}

QATTN_HD float e4m3_round(float x) { return e4m3_decode(e4m3_encode(x)); }

// ---- E5M2 -----------------------------------------------------------------------

QATTN_HD uint8_t e5m2_encode(float x) {
  return static_cast<uint8_t>(detail::encode_saturating<detail::kE5M2Man, detail::kE5M2Bias>(
      x, detail::kE5M2MaxCode, kE5M2NaN, detail::kFp8SignBit));
}

QATTN_HD float e5m2_decode(uint8_t code) {
  const uint32_t m = code & detail::kFp8AbsMask;
  const bool neg = (code & detail::kFp8SignBit) != 0;
  if (m > detail::kE5M2InfCode) return detail::float_of(detail::kF32QuietNaN);
  if (m == detail::kE5M2InfCode) {
    return detail::float_of(detail::kF32InfBits | (neg ? detail::kF32SignMask : 0u));
  }
  const float v = detail::decode_magnitude<detail::kE5M2Man, detail::kE5M2Bias>(m);
  return neg ? -v : v;
}

QATTN_HD float e5m2_round(float x) { return e5m2_decode(e5m2_encode(x)); }

// ---- E2M1 -----------------------------------------------------------------------

// 4-bit code in the low nibble; NaN -> 0 (no NaN code, see the top comment).
QATTN_HD uint8_t e2m1_encode(float x) {
  if (detail::is_nan_bits(detail::bits_of(x))) return 0;
  return static_cast<uint8_t>(detail::encode_saturating<detail::kE2M1Man, detail::kE2M1Bias>(
      x, detail::kE2M1MaxCode, 0u, kE2M1SignBit));
}

// Reads the low nibble only.
QATTN_HD float e2m1_decode(uint8_t code) {
  const float v =
      detail::decode_magnitude<detail::kE2M1Man, detail::kE2M1Bias>(code & detail::kE2M1MaxCode);
  return (code & kE2M1SignBit) ? -v : v;
}

// decode(encode(x)), except that NaN stays NaN.
QATTN_HD float e2m1_round(float x) {
  if (detail::is_nan_bits(detail::bits_of(x))) return x;
  return e2m1_decode(e2m1_encode(x));
}

// ---- E8M0 -----------------------------------------------------------------------

inline constexpr int kE8M0MinExponent = -127;
inline constexpr int kE8M0MaxExponent = 127;

// The code of 2^e; e is clamped to [-127, 127] (saturation, never NaN).
QATTN_HD uint8_t e8m0_encode_exponent(int e) {
  if (e < kE8M0MinExponent) e = kE8M0MinExponent;
  if (e > kE8M0MaxExponent) e = kE8M0MaxExponent;
  return static_cast<uint8_t>(e + kE8M0Bias);
}

// 2^(code - 127) (2^-127 is a float subnormal, exact); 0xFF -> NaN.
QATTN_HD float e8m0_decode(uint8_t code) {
  if (code == kE8M0NaN) return detail::float_of(detail::kF32QuietNaN);
  return detail::exp2i(static_cast<int>(code) - kE8M0Bias);
}

// ---- FP16 / BF16 ----------------------------------------------------------------

namespace detail {
inline constexpr int kF16Man = 10;
inline constexpr int kF16Bias = 15;
inline constexpr uint32_t kF16MaxCode = 0x7BFF;
inline constexpr uint32_t kF16InfCode = 0x7C00;
inline constexpr uint16_t kF16NaN = 0x7E00;
inline constexpr uint16_t kF16SignBit = 0x8000;
inline constexpr uint16_t kF16AbsMask = 0x7FFF;
inline constexpr uint16_t kF16ExpMask = 0x7C00;
inline constexpr int kBf16Shift = 16;  // bf16 = the top half of a float
inline constexpr uint32_t kBf16QuietBit = 0x00400000u;
}  // namespace detail

// IEEE binary16 bits of x: RNE, overflow to ±Inf, NaN -> a quiet NaN.
QATTN_HD uint16_t fp16_bits(float x) {
  const uint32_t b = detail::bits_of(x);
  if (detail::is_nan_bits(b)) return detail::kF16NaN;
  const uint16_t sign = (b & detail::kF32SignMask) ? detail::kF16SignBit : 0;
  const uint32_t abs_b = b & detail::kF32AbsMask;
  if (abs_b == detail::kF32InfBits) return sign | detail::kF16InfCode;
  const uint32_t m =
      detail::encode_magnitude<detail::kF16Man, detail::kF16Bias>(detail::float_of(abs_b));
  return static_cast<uint16_t>(sign | (m > detail::kF16MaxCode ? detail::kF16InfCode : m));
}

QATTN_HD float fp16_from_bits(uint16_t h) {
  const uint16_t m = h & detail::kF16AbsMask;
  const bool neg = (h & detail::kF16SignBit) != 0;
  if ((m & detail::kF16ExpMask) == detail::kF16ExpMask) {
    if (m != detail::kF16InfCode) return detail::float_of(detail::kF32QuietNaN);
    return detail::float_of(detail::kF32InfBits | (neg ? detail::kF32SignMask : 0u));
  }
  const float v = detail::decode_magnitude<detail::kF16Man, detail::kF16Bias>(m);
  return neg ? -v : v;
}

QATTN_HD float fp16_round(float x) { return fp16_from_bits(fp16_bits(x)); }

// bfloat16 bits of x: RNE on the top 16 bits, overflow to ±Inf, NaN stays NaN.
QATTN_HD uint16_t bf16_bits(float x) {
  uint32_t b = detail::bits_of(x);
  if (detail::is_nan_bits(b)) return static_cast<uint16_t>((b | detail::kBf16QuietBit) >> 16);
  const uint32_t lsb = (b >> detail::kBf16Shift) & 1u;
  const uint32_t half_minus_one = (1u << (detail::kBf16Shift - 1)) - 1u;
  b += half_minus_one + lsb;  // ties go to the even top half; a carry rounds up to Inf
  return static_cast<uint16_t>(b >> detail::kBf16Shift);
}

QATTN_HD float bf16_from_bits(uint16_t h) {
  return detail::float_of(static_cast<uint32_t>(h) << detail::kBf16Shift);
}

QATTN_HD float bf16_round(float x) { return bf16_from_bits(bf16_bits(x)); }

}  // namespace qattn::numerics
