// Where a thread's wgmma accumulator elements sit (see hopper/wgmma.cuh): element i of
// an m64nN accumulator is row (i % 4 < 2 ? g : g + 8) of the warp's 16 rows, column
// 8 * (i / 4) + 2 * t + (i % 2).
#pragma once

namespace qattn::common {

struct FragCoord {
  int g, t;  // lane / 4, lane % 4
  __device__ __forceinline__ static bool upper_row(int i) { return (i % 4) >= 2; }
  __device__ __forceinline__ int col(int i) const { return 8 * (i / 4) + 2 * t + (i % 2); }
};

}  // namespace qattn::common
