// The default softmax scale 1/sqrt(d), computed in double and rounded once to float.
// The C library's paths that resolve sm_scale = 0 (the API's defaults, the launches) use
// this one function. The FP64 reference computes 1/sqrt(d) in double and the emulators
// round that to float, so a kernel that computed it in float (1.f / sqrtf(d), two
// roundings) would quantize Q with another scale at head dims where the two differ by
// one ulp (96, 112 and 136 among them).
#pragma once

#include <cmath>

namespace qattn::numerics {

inline float default_sm_scale(int head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

}  // namespace qattn::numerics
