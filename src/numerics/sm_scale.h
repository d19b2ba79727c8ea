// The default softmax scale 1/sqrt(d), computed in double and rounded once to float.
// Every path that resolves sm_scale = 0 uses this one function: the FP64 reference
// computes 1/sqrt(d) in double and the emulators round it to float, so a kernel that
// computed it in float (1.f / sqrtf(d), two roundings) would quantize Q with another
// scale at head dims where the two differ by one ulp (d = 136 is one).
#pragma once

#include <cmath>

namespace qattn::numerics {

inline float default_sm_scale(int head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

}  // namespace qattn::numerics
