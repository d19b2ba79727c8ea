// The shared-memory swizzle of a TMA tile, named once for both sides that must agree:
// the tensor map that writes the tile (tensor_map.h, host) and the wgmma descriptor
// that reads it (wgmma.cuh, device). The values are the descriptor's layout-type field.
#pragma once

#include <cstdint>

#include "numerics/hd.h"

namespace qattn::hopper {

enum class Swizzle : uint64_t { k128B = 1, k64B = 2, k32B = 3 };

// The span of the swizzle pattern: the row length of a K-major tile in bytes.
QATTN_HD constexpr uint32_t swizzle_bytes(Swizzle s) {
  return s == Swizzle::k128B ? 128 : s == Swizzle::k64B ? 64 : 32;
}

}  // namespace qattn::hopper
