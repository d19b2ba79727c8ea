// The NVFP4 element code without a division, host and device: numerics::
// fp4_element_code(x, s) is e2m1_encode(fl(x / s)), and each step of the E2M1 code is
// decided by comparing |x| with t·s, an exact FP32 product. Used where a kernel codes
// many elements with one scale (the KV-cache append, the SageAttention3 P blocks);
// tests/gpu/test_kv_append.cpp checks it against the quantizer at every E4M3 scale.
#pragma once

#include <cstdint>

#include "numerics/formats.h"
#include "numerics/hd.h"

namespace qattn::numerics {

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

}  // namespace qattn::numerics
