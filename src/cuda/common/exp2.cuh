// 2^x on the MUFU pipe (ex2.approx.ftz): the softmax's exponential. The FMA-pipe
// polynomial with the same contract is numerics/exp2_poly.h.
#pragma once

namespace qattn::common {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace qattn::common
