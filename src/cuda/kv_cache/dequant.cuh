// Reading the cache on the GPU: turning a row's codes into the 16-bit operands of the
// decode's tensor-core products (the staging itself is common/mma_sync.cuh's cp.async
// with zero fill). Every conversion here is exact:
//   NVFP4: E2M1 · E4M3 has at most 6 significant bits and lies in [2^-10, 2688], so it
//          is exact in FP16 and in BF16 (the products a Blackwell block-scaled MMA forms);
//   FP8 E4M3 and INT8 codes are exact in FP16 and BF16; their per-row FP32 scale is
//          applied outside the product (scores: after Q·Kᵀ; P·V: folded into P);
//   BF16 is used as stored.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/common/mma_sync.cuh"
#include "kvcache/layout.h"

namespace qattn::kv_cache {

using common::cp_async_zfill;
using common::ldmatrix_x4_trans;
using kvcache::KvFormat;

// The FP16 bit patterns of two E2M1 codes (the low and high nibble of `byte`), each
// 2^-14 times the E2M1 value: with the code's 3 magnitude bits at FP16 bits 11..9 the
// exponent field is E2M1's and the mantissa's top bit its mantissa, which reads as
// 2^(e-15)·(1 + m/2) (e > 0) or m·2^-15 (e = 0), both 2^-14 of E2M1's 2^(e-1)·(1 + m/2)
// and m/2.
__device__ __forceinline__ uint32_t e2m1x2_as_f16x2_bits(uint32_t byte) {
  return ((byte & 0x7u) << 9) | ((byte & 0x8u) << 12) | ((byte & 0x70u) << 21) |
         ((byte & 0x80u) << 24);
}

// The same FP16 patterns for the eight E2M1 codes of `w`, as their high bytes (sign,
// then the 3 magnitude bits at bits 3..1; the low byte is 0): `even` holds those of
// nibbles 0, 2, 4, 6 in bytes 0..3, `odd` those of nibbles 1, 3, 5, 7.
__device__ __forceinline__ void e2m1_high_bytes(uint32_t w, uint32_t& even, uint32_t& odd) {
  even = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
  odd = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
}

__device__ __forceinline__ __half2 as_half2(uint32_t bits) {
  __half2 h;
  memcpy(&h, &bits, 4);
  return h;
}
__device__ __forceinline__ uint32_t bits_of(__half2 h) {
  uint32_t b;
  memcpy(&b, &h, 4);
  return b;
}
__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 h) {
  uint32_t b;
  memcpy(&b, &h, 4);
  return b;
}

// Exact FP16 → BF16 of values with at most 8 significant bits (all values here).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t bits) {
  return bits_of(__float22bfloat162_rn(__half22float2(as_half2(bits))));
}

// E4M3 code → FP16 (exact; hardware conversion, sm_89 and later).
__device__ __forceinline__ __half e4m3_to_half(uint8_t code) {
  const __half_raw r = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half(r);
}
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2_bits(uint16_t codes) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3);
  uint32_t b;
  memcpy(&b, &r, 4);
  return b;
}

// Eight elements of a row (8 consecutive elements from element 8·c8) as 16-bit
// operands: FP16 (`kBf16` false) or BF16. `codes` points at the row's raw codes,
// `scales` at its raw scales. FP8/INT8 produce the codes' values (their row scale is
// applied by the caller); NVFP4 the dequantized values.
template <KvFormat F, bool kBf16>
__device__ __forceinline__ uint4 dequant8(const uint8_t* codes, const uint8_t* scales, int c8) {
  uint32_t out[4];
  if constexpr (F == KvFormat::NvFp4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + 4 * c8);
    const __half2 s = __half2half2(e4m3_to_half(scales[c8 / 2]));  // 16 elements per scale
    const __half2 two14 = __float2half2_rn(16384.f);
    for (int k = 0; k < 4; ++k) {
      const uint32_t bits = e2m1x2_as_f16x2_bits((w >> (8 * k)) & 0xFFu);
      // (code·2^-14)·2^14 is the E2M1 value; times s it is exact in FP16 (see above).
      // The 2^14 goes on the code, not the scale: 448·2^14 would overflow FP16.
      const __half2 v = __hmul2(__hmul2(as_half2(bits), two14), s);
      out[k] = kBf16 ? f16x2_to_bf16x2(bits_of(v)) : bits_of(v);
    }
  } else if constexpr (F == KvFormat::Fp8E4M3) {
    const uint2 w = *reinterpret_cast<const uint2*>(codes + 8 * c8);
    const uint32_t words[2] = {w.x, w.y};
    for (int k = 0; k < 4; ++k) {
      const uint32_t bits =
          e4m3x2_to_f16x2_bits(static_cast<uint16_t>(words[k / 2] >> (16 * (k % 2))));
      out[k] = kBf16 ? f16x2_to_bf16x2(bits) : bits;
    }
  } else if constexpr (F == KvFormat::Int8) {
    const uint2 w = *reinterpret_cast<const uint2*>(codes + 8 * c8);
    const uint32_t words[2] = {w.x, w.y};
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = words[k / 2] >> (16 * (k % 2));
      const float lo = static_cast<float>(static_cast<int8_t>(word & 0xFFu));
      const float hi = static_cast<float>(static_cast<int8_t>((word >> 8) & 0xFFu));
      out[k] = kBf16 ? bits_of(__floats2bfloat162_rn(lo, hi)) : bits_of(__floats2half2_rn(lo, hi));
    }
  } else {
    static_assert(F != KvFormat::Bf16, "BF16 rows are used as stored");
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The FP32 row scale of an FP8/INT8 row (little-endian, at the start of its scales).
__device__ __forceinline__ float row_scale(const uint8_t* scales) {
  return *reinterpret_cast<const float*>(scales);
}

}  // namespace qattn::kv_cache
