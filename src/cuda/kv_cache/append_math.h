// Element arithmetic of the KV-cache append kernel (append.cu) that must equal the host
// emulation (emulate/kv_cache.cpp) bit for bit, written once for host and device
// (QATTN_HD) so the host can check it against the numerics quantizers.
//
// Two parts:
//  - NaN results as the x86-64 host computes them. The emulation runs on the host, and
//    its K − c, the double sums of the prefill mean and their casts store NaN bits in
//    k_mean and in BF16 rows. SSE returns the first NaN operand, quieted, else the
//    "default NaN" 0xFFC00000 (negative); the GPU returns 0x7FFFFFFF for all of them.
//    These helpers give the SSE bits on both. (Where both operands of a sum are NaN
//    with different bits, the host's choice depends on which of its loops ran, vector
//    or scalar: a column of the mean's sample holding two different NaNs is the one
//    input whose k_mean bits are not pinned.)
//  - The NVFP4 element code without a division: numerics::fp4_element_code(x, s) is
//    e2m1_encode(fl(x / s)), and each step of the E2M1 code is decided by comparing |x|
//    with t·s, an exact FP32 product (see Nvfp4Steps).
#pragma once

#include <cstdint>

#include "numerics/formats.h"
#include "numerics/hd.h"

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace qattn::kv_cache {

namespace detail {
inline constexpr uint32_t kF32Quiet = 0x00400000u;
inline constexpr uint32_t kF32DefaultNaN = 0xFFC00000u;  // SSE's "real indefinite"
inline constexpr uint64_t kF64Quiet = 0x0008000000000000ull;
inline constexpr uint64_t kF64DefaultNaN = 0xFFF8000000000000ull;

QATTN_HD uint64_t bits64(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  return std::bit_cast<uint64_t>(x);
#endif
}
QATTN_HD double double_of(uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  return std::bit_cast<double>(b);
#endif
}
QATTN_HD float quiet(float x) {
  return numerics::detail::float_of(numerics::detail::bits_of(x) | kF32Quiet);
}
QATTN_HD double quiet(double x) { return double_of(bits64(x) | kF64Quiet); }
}  // namespace detail

// a − b in FP32 (RNE, never contracted), with the host's NaN.
QATTN_HD float host_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fsub_rn(a, b);
#else
  const float r = a - b;
#endif
  if (r == r) return r;
  if (a != a) return detail::quiet(a);
  if (b != b) return detail::quiet(b);
  return numerics::detail::float_of(detail::kF32DefaultNaN);
}

// float -> double (exact); a NaN keeps its sign and payload, quieted.
QATTN_HD double host_widen(float x) {
  if (x != x) {
    const uint32_t b = numerics::detail::bits_of(x) | detail::kF32Quiet;
    const uint64_t sign = static_cast<uint64_t>(b >> 31) << 63;
    const uint64_t payload = static_cast<uint64_t>(b & 0x007FFFFFu) << 29;
    return detail::double_of(sign | 0x7FF0000000000000ull | payload);
  }
  return static_cast<double>(x);
}

// a + b in double, with the host's NaN (a's when both are NaN).
QATTN_HD double host_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  const double r = __dadd_rn(a, b);
#else
  const double r = a + b;
#endif
  if (r == r) return r;
  if (a != a) return detail::quiet(a);
  if (b != b) return detail::quiet(b);
  return detail::double_of(detail::kF64DefaultNaN);
}

// a / n for a count n >= 1, in double, with the host's NaN.
QATTN_HD double host_div(double a, double n) {
  if (a != a) return detail::quiet(a);
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, n);
#else
  return a / n;
#endif
}

// double -> float (RNE); a NaN keeps its sign and the top 22 bits of its payload, quieted.
QATTN_HD float host_to_float(double x) {
  if (x != x) {
    const uint64_t b = detail::bits64(x);
    const uint32_t sign = static_cast<uint32_t>(b >> 63) << 31;
    const uint32_t payload = static_cast<uint32_t>((b >> 29) & 0x007FFFFFu);
    return numerics::detail::float_of(sign | 0x7F800000u | detail::kF32Quiet | payload);
  }
#if defined(__CUDA_ARCH__)
  return __double2float_rn(x);
#else
  return static_cast<float>(x);
#endif
}

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 by a multiply-high and a shift (Granlund and
// Montgomery's round-up method: mul = floor(2^32·(2^l − d)/d) + 1 with 2^l >= d > 2^(l−1),
// q = (mulhi(n, mul) + n) >> l; the sum stays below 2^32 as n < 2^31). The kernels
// divide token positions by the page size and row indices by the tokens of a CTA.
struct FastDiv {
  uint32_t divisor = 1, mul = 1, shift = 0;

  QATTN_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

QATTN_HD FastDiv make_fast_div(uint32_t d) {
  FastDiv f;
  f.divisor = d;
  while ((uint64_t{1} << f.shift) < d) ++f.shift;
  f.mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
  return f;
}

// The E2M1 code of fl(x / s) for one NVFP4 block scale s (finite, > 0), from
// comparisons of |x| with the products t·s. Why exact: e2m1_encode rounds fl(q), q = |x| / s, to
// one mantissa bit; its code steps where fl(q) crosses t = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5 and 5,
// each with an even last mantissa bit, so at a tie fl(q) rounds to t itself:
//   fl(q) > t  <=>  q > t + ulp(t)/2   (steps at 0.25, 1.25, 2.5, 5: t rounds down)
//   fl(q) >= t <=>  q >= t − ulp(t)/2  (steps at 0.75, 1.75, 3.5: t is reached)
// Scaled by s, the bound (t ± ulp(t)/2)·s lies strictly between A = t·s (exact: t has
// at most 3 significant bits, s at most 4) and its neighbouring float, as
// (ulp(t)/2)·s < ulp(A) and, for the second kind, A is never a power of two (t is 3 or 7
// times a power of two, s an integer 1..15 times one). So |x| > A and |x| >= A decide
// the steps exactly.
// Every product is at least 0.25 · 2^-9 (the smallest E4M3 subnormal): normal floats.
// The steps as |x| >= u[i] (u[i] = succ(A) where the step is |x| > A): code = the number
// of steps |x| has reached.
struct Nvfp4Steps {
  float u[7];
};

QATTN_HD Nvfp4Steps nvfp4_steps(float s) {
  constexpr float kStep[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  Nvfp4Steps st;
  for (int i = 0; i < 7; ++i) {
#if defined(__CUDA_ARCH__)
    const float a = __fmul_rn(kStep[i], s);
#else
    const float a = kStep[i] * s;
#endif
    // Even i: the step is |x| > a, i.e. |x| >= the next float (a is positive and finite).
    st.u[i] = i % 2 == 0 ? numerics::detail::float_of(numerics::detail::bits_of(a) + 1u) : a;
  }
  return st;
}

// numerics::fp4_element_code(x, s) for a block whose s is finite and > 0 (x is then not
// NaN: a NaN would have made s NaN). The code's three bits by a binary search over the
// steps; the sign is x's (that of x / s), also for −0.
QATTN_HD uint32_t nvfp4_code(float x, const Nvfp4Steps& st) {
  const uint32_t bits = numerics::detail::bits_of(x);
  const float a = numerics::detail::float_of(bits & 0x7FFFFFFFu);
  const bool b2 = a >= st.u[3];
  const bool b1 = a >= (b2 ? st.u[5] : st.u[1]);
  const bool b0 = a >= (b2 ? (b1 ? st.u[6] : st.u[4]) : (b1 ? st.u[2] : st.u[0]));
  const uint32_t m = (b2 ? 4u : 0u) | (b1 ? 2u : 0u) | (b0 ? 1u : 0u);
  return m | ((bits >> 28) & numerics::kE2M1SignBit);
}

}  // namespace qattn::kv_cache
