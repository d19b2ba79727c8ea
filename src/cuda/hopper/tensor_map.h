// Host side of TMA: building CUtensorMap descriptors without linking libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace qattn::hopper {

enum class TmaSwizzle { k64B, k128B };

// A 3-D map over a contiguous uint8 tensor (dim0 innermost, dim0 * dim1 * dim2 bytes),
// with box (box0, box1, 1). Returns cudaSuccess, or an error if the driver entry point
// is missing or the encode fails.
cudaError_t make_tensor_map_u8_3d(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1,
                                  uint64_t dim2, uint32_t box0, uint32_t box1, TmaSwizzle swizzle);

}  // namespace qattn::hopper
