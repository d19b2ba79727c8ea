// An additive attn_mask value (SDPA's float mask) in the softmax's log2 units, as the
// SA2-8b kernel and its emulation add it to a score: add·log2(e) in FP32, -inf kept (the
// key is hidden). A finite value below kLowestAdditive (bf16's and FP32's lowest, which
// transformers writes for "masked") saturates there instead of overflowing to -inf, so a
// row whose every value is that low still averages its keys, as SDPA's FP32 math does.
#pragma once

#include <cmath>

#include "numerics/hd.h"

namespace qattn::numerics {

inline constexpr float kLowestAdditive = -2.3e38f;  // times log2(e): still finite in FP32

QATTN_HD float additive_log2(float add) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (add == -INFINITY) return add;
  const float a = add < kLowestAdditive ? kLowestAdditive : add;
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, kLog2e);  // not contracted into the caller's add
#else
  return a * kLog2e;
#endif
}

}  // namespace qattn::numerics
