// Host side of TMA: building CUtensorMap descriptors without linking libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/hopper/swizzle.h"
#include "qattn/qattn.h"

namespace qattn::hopper {

// A 3-D map over a contiguous uint8 tensor (dim0 innermost, dim0 * dim1 * dim2 bytes),
// with box (box0, box1, 1). Returns cudaSuccess, or an error if the driver entry point
// is missing or the encode fails.
cudaError_t make_tensor_map_u8_3d(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1,
                                  uint64_t dim2, uint32_t box0, uint32_t box1, Swizzle swizzle);

// A 3-D map over a contiguous FP32 tensor (dim0 innermost, in elements), with box (box0,
// box1, 1) and 128-byte swizzle (box0 = 32 elements): the target of TMA reductions.
cudaError_t make_tensor_map_f32_3d(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1,
                                   uint64_t dim2, uint32_t box0, uint32_t box1);

// A 4-D map over a strided 16-bit tensor (a caller's q, k, v or o: dims innermost first,
// strides of dims 1..3 in elements, each a multiple of 8), with box (box0, box1, 1, 1)
// and 128-byte swizzle (box0 = 64 elements). Out-of-range elements read as zero and are
// not written by stores.
cudaError_t make_tensor_map_16bit_4d(CUtensorMap* map, const void* base, const uint64_t (&dims)[4],
                                     const uint64_t (&strides)[3], uint32_t box0, uint32_t box1);

// A caller's (B, H, N, d) 16-bit tensor as a 4-D tensor map (cols, N, H, B) with boxes
// of 64 channels × box_rows rows; rows past N and channels past `cols` read as zero and
// are never written. A dimension of extent 1 may carry any stride (the api ignores it),
// so it gets a valid one here (rows of head_dim rounded up to 8 elements).
cudaError_t make_bhnd_map(CUtensorMap* map, const qattn_tensor& t, int batch, int head_dim,
                          int cols, int heads, int seqlen, uint32_t box_rows);

}  // namespace qattn::hopper
