// Writing the backward's 16-bit outputs (dQ, dK, dV) into the caller's strided tensors:
// one element at a time, or several per store where the rows are aligned for it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/pack16.cuh"
#include "cuda/sagebwd/args.h"

namespace qattn::sagebwd {

using common::pack2;  // two outputs in one 4-byte word

template <typename T>
__device__ __forceinline__ void store_out(T* p, float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *p = __float2bfloat16_rn(x);
  else
    *p = __float2half_rn(x);
}

// Whether every row of a (B, H, N, d) output starts on a `kBytes` boundary, so that
// element offsets that are multiples of kBytes / sizeof(T) take kBytes-wide stores: one
// store instead of kBytes / 2 single-element ones (which fetch and write each sector
// several times over). The C ABI's checks (16-byte aligned data, strides in multiples of
// 8 elements) make it hold for every call that reaches a kernel; the element-wise stores
// remain for the head-dim tail and for an output that would not hold it.
template <typename T, int kBytes>
__device__ __forceinline__ bool rows_aligned(const StridedOut& o) {
  constexpr int64_t kElems = kBytes / sizeof(T);
  return reinterpret_cast<uintptr_t>(o.data) % kBytes == 0 &&
         ((o.sb | o.sh | o.sn) & (kElems - 1)) == 0;
}

}  // namespace qattn::sagebwd
