// The NVFP4 block scale on the GPU: numerics::nvfp4_scale_code(amax) by the E4M3
// conversion instruction, and its value. Shared by the KV-cache append and the
// SageAttention3 forward's P blocks.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "cuda/common/e4m3.cuh"
#include "numerics/formats.h"

namespace qattn::common {

// numerics::nvfp4_scale_code(amax) and its value s: a non-finite amax gives the NaN code;
// else E4M3(amax / 6), amax / 6 being finite and >= 0, by the conversion instruction.
__device__ __forceinline__ uint8_t nvfp4_scale(float amax, float& s) {
  if (!(amax <= FLT_MAX)) {
    s = numerics::detail::float_of(numerics::detail::kF32QuietNaN);
    return numerics::kE4M3NaN;
  }
  const auto sc = static_cast<uint8_t>(
      common::quantize_e4m3x2(__fdiv_rn(amax, numerics::kE2M1Max), 0.f) & 0xFFu);
  s = __half2float(__half(__nv_cvt_fp8_to_halfraw(sc, __NV_E4M3)));  // exact
  return sc;
}

}  // namespace qattn::common
