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
//  (The NVFP4 element code without a division is numerics/nvfp4_code.h.)
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

}  // namespace qattn::kv_cache
