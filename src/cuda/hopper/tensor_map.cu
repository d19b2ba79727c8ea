#include "cuda/hopper/tensor_map.h"

namespace qattn::hopper {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// CUDA 13 removed unversioned driver entry points; ask for the 12.0 ABI of the call.
EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiledFn>(nullptr);
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

}  // namespace

cudaError_t make_tensor_map_u8_3d(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1,
                                  uint64_t dim2, uint32_t box0, uint32_t box1, Swizzle swizzle) {
  EncodeTiledFn encode = encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {dim0, dim1, dim2};
  const cuuint64_t strides[2] = {dim0, dim0 * dim1};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle == Swizzle::k128B  ? CU_TENSOR_MAP_SWIZZLE_128B
             : swizzle == Swizzle::k64B ? CU_TENSOR_MAP_SWIZZLE_64B
                                        : CU_TENSOR_MAP_SWIZZLE_32B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t make_tensor_map_f32_3d(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1,
                                   uint64_t dim2, uint32_t box0, uint32_t box1) {
  EncodeTiledFn encode = encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {dim0, dim1, dim2};
  const cuuint64_t strides[2] = {dim0 * 4, dim0 * dim1 * 4};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<void*>(base), dims,
                            strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t make_tensor_map_16bit_4d(CUtensorMap* map, const void* base, const uint64_t (&dims)[4],
                                     const uint64_t (&strides)[3], uint32_t box0, uint32_t box1) {
  EncodeTiledFn encode = encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t gdims[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint64_t gstrides[3] = {strides[0] * 2, strides[1] * 2, strides[2] * 2};  // bytes
  const cuuint32_t box[4] = {box0, box1, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), gdims,
                            gstrides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t make_bhnd_map(CUtensorMap* map, const qattn_tensor& t, int batch, int head_dim,
                          int cols, int heads, int seqlen, uint32_t box_rows) {
  const auto round8 = [](int64_t x) { return (x + 7) / 8 * 8; };
  const int64_t sn = seqlen > 1 ? t.stride_n : round8(head_dim);
  const int64_t sh = heads > 1 ? t.stride_h : sn * seqlen;
  const int64_t sb = batch > 1 ? t.stride_b : sh * heads;
  const uint64_t dims[4] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(seqlen),
                            static_cast<uint64_t>(heads), static_cast<uint64_t>(batch)};
  const uint64_t strides[3] = {static_cast<uint64_t>(sn), static_cast<uint64_t>(sh),
                               static_cast<uint64_t>(sb)};
  return make_tensor_map_16bit_4d(map, t.data, dims, strides, 64, box_rows);
}

}  // namespace qattn::hopper
