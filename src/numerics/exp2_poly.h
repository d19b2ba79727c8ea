// 2^x without the MUFU unit, for a share of the SA2 kernel's softmax exps (the MUFU pipe
// runs at a quarter of the FMA rate; bench/NOTES.md v15d). Host and device, so the CPU
// tests can check it (tests/cpu/test_int32_scores.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "numerics/formats.h"
#include "numerics/hd.h"
#include "numerics/int32_scores.h"

namespace qattn::numerics {

// x = n + f with n = rint(x) (the FADD of 1.5·2^23 puts n in the low bits of t) and
// f in [-0.5, 0.5]; 2^f by a degree-3 polynomial fitted for relative error (< 7.6e-5,
// far inside E4M3's step of 2^-4); 2^n added to the exponent bits (t << 23 leaves n << 23:
// the offset's low 9 bits are 0). x is clamped at -100 first, so -inf (a masked score)
// and very small P give 2^-100, which casts to E4M3 zero as 2^x would. A NaN x is clamped
// too (fmaxf drops it): the kernel's other exps still carry the NaN into O.
// FMA and ALU pipes only: 1 FMNMX, 3 FADD, 3 FFMA, 1 SHL, 1 IADD.
QATTN_HD float exp2_poly(float x) {
  x = fmaxf(x, -100.f);
  const float t = x + scores::kMagic;  // 1.5·2^23, the same offset as the score conversion
  const float f = x - (t - scores::kMagic);
  const float p = fmaf(fmaf(fmaf(0.05517084f, f, 0.24260935f), f, 0.69326097f), f, 0.99992818f);
  return detail::float_of(detail::bits_of(p) + (detail::bits_of(t) << 23));
}

}  // namespace qattn::numerics
