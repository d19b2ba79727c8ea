// E4M3 (OCP FP8) on the GPU: the format's range and packing two values into codes.
// The constants are numerics/formats.h's, which the CPU emulation uses too.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "numerics/formats.h"

namespace qattn::common {

using numerics::kE4M3Max;      // 448
using numerics::kLog2E4M3Max;  // log2(448)

// Two E4M3 values packed as in a register fragment: `lo` in the low byte (RNE,
// saturating to ±448).
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The same codes through cuda_fp8.h, widened to 32 bits (the quantization kernels
// shift them into place).
__device__ __forceinline__ uint32_t quantize_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace qattn::common
