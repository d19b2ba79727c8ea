// The byte layout of a page of the KV cache (docs/kv-cache.md, "Bytes of a page"): the
// one definition the host emulation, the C ABI's size query and the GPU kernels share.
// Plain arithmetic with no checks and no exceptions, so device code can include it;
// callers validate the sizes first (emulate::kv_page_layout, api validation).
#pragma once

#include <cstdint>

namespace qattn::kvcache {

// Element format of the cached K and V; the values are qattn.h's qattn_kv_format.
enum class KvFormat : int32_t {
  NvFp4 = 0,    // E2M1 codes, 2 per byte; one E4M3 scale per 16 elements along d
  Fp8E4M3 = 1,  // E4M3 codes; one FP32 scale per (token, head) = amax/448
  Int8 = 2,     // int8 codes; one FP32 scale per (token, head) = amax/127
  Bf16 = 3,     // bfloat16 values; no scale
};

inline constexpr int kAlignment = 16;   // bytes; sections and head slices of a page
inline constexpr int kNvFp4Block = 16;  // elements along d per NVFP4 scale
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kMaxQueryTokens = 16;
inline constexpr int kDecodeChunkAlign = 16;  // keys; a decode chunk starts on a multiple

// Keys per chunk of a decode split `splits` ways over `length` cached keys: ⌈length /
// splits⌉ rounded up to a multiple of 16, so every chunk starts on a 16-key boundary and
// a 16-key block of a chunk lies in one page wherever pages hold a multiple of 16 keys
// (the direct decode kernel then reads one block-table entry per block). 0 for length 0.
constexpr int decode_chunk_keys(int length, int splits) {
  const int even = (length + splits - 1) / splits;
  return (even + kDecodeChunkAlign - 1) / kDecodeChunkAlign * kDecodeChunkAlign;
}

// Byte layout of one page (all offsets from the page's first byte).
struct KvPageLayout {
  int64_t code_row_bytes = 0;    // one (token, head) row of codes: d/2, d, d or 2d
  int64_t scale_row_bytes = 0;   // its scales: d/16 (E4M3), 4 (FP32), 4 (FP32) or 0
  int64_t head_code_bytes = 0;   // one head's slice of a code section (16-aligned)
  int64_t head_scale_bytes = 0;  // one head's slice of a scale section (16-aligned)
  int64_t k_codes = 0, v_codes = 0, k_scales = 0, v_scales = 0;  // section offsets
  int64_t page_bytes = 0;                                        // a multiple of 16

  // Offsets of the (slot, head) row within a page; v selects V instead of K.
  constexpr int64_t code_offset(bool v, int slot, int head) const {
    return (v ? v_codes : k_codes) + head * head_code_bytes + slot * code_row_bytes;
  }
  constexpr int64_t scale_offset(bool v, int slot, int head) const {
    return (v ? v_scales : k_scales) + head * head_scale_bytes + slot * scale_row_bytes;
  }
};

constexpr int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The layout for valid sizes (format an enumerator, head_dim a multiple of 16 in
// 16..256, heads_kv and page_size >= 1).
constexpr KvPageLayout page_layout(KvFormat format, int heads_kv, int head_dim, int page_size) {
  KvPageLayout l;
  const int64_t d = head_dim;
  switch (format) {
    case KvFormat::NvFp4:
      l.code_row_bytes = d / 2;
      l.scale_row_bytes = d / kNvFp4Block;
      break;
    case KvFormat::Fp8E4M3:
    case KvFormat::Int8:
      l.code_row_bytes = d;
      l.scale_row_bytes = 4;  // one FP32
      break;
    case KvFormat::Bf16:
      l.code_row_bytes = 2 * d;
      l.scale_row_bytes = 0;
      break;
  }
  l.head_code_bytes = align_up(page_size * l.code_row_bytes, kAlignment);
  l.head_scale_bytes = align_up(page_size * l.scale_row_bytes, kAlignment);
  const int64_t code_section = heads_kv * l.head_code_bytes;
  const int64_t scale_section = heads_kv * l.head_scale_bytes;
  l.k_codes = 0;
  l.v_codes = code_section;
  l.k_scales = 2 * code_section;
  l.v_scales = 2 * code_section + scale_section;
  l.page_bytes = 2 * code_section + 2 * scale_section;  // every term is a multiple of 16
  return l;
}

}  // namespace qattn::kvcache
