// The SA2-8b forward's attn_mask (qattn_fwd_params' attn_mask, boolean or additive):
// how the kernel reads it. A pass before the attention kernel (attn_mask_tiles.cu) classifies every
// 128 x 128 tile of each query block and writes, per (mask slice, query block), the
// list of tiles that have a visible key; the loaders walk that list instead of a span
// of tiles, so hidden tiles are never loaded. Each entry says whether its tile is
// entirely visible (run as if unmasked) or cut (each element tested against the
// mask's bits, which the pass also writes: a bit per (row, key)). An additive mask's
// tiles are hidden (every value -inf), unchanged (every value ±0: run as if unmasked) or
// cut (the consumers add the caller's values: AdditivePairs); it has no bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/fragment.cuh"
#include "numerics/int32_scores.h"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {

// A list entry: the tile number, with a flag.
inline constexpr int kMaskTileBits = 0x00ffffff;  // tile numbers < 2^24 (seqlen <= 2^30)
inline constexpr int kMaskTileCut = 1 << 24;      // some of its keys are hidden
inline constexpr int kMaskTileHidden = 1 << 25;   // the block sees no key at all: a list
                                                  // of one hidden tile (every item runs a tile)

// The mask as the kernel reads it; tiles == nullptr without one.
struct AttnMaskView {
  const uint8_t* data;                             // the caller's bytes (the pass reads them)
  int64_t stride_b, stride_h, stride_q, stride_k;  // bytes; 0 broadcasts
  const int* tiles;  // per slice and query block: [count, entries...], list_len ints
  unsigned* bits;    // per slice, row (nq_pad) and KV tile: 4 words (tile_words)
  int list_len;      // 1 + the KV tiles of the call
  int per_batch, per_head;  // whether the mask has its own slice per b / per query head
  int heads_q, num_m_blocks;
  int additive;  // QATTN_MASK_ADDITIVE: data holds 2-byte values of the call's dtype
  int bf16;      // with additive: the values are bf16 (else fp16)

  __host__ __device__ __forceinline__ int slice(int bh_q) const {
    const int b = bh_q / heads_q, hq = bh_q % heads_q;
    return (per_batch ? b : 0) * (per_head ? heads_q : 1) + (per_head ? hq : 0);
  }
  // Where the list of the item with query block m_block of (b, hq) = bh_q starts in
  // `tiles` (an int: the family keeps every list below 2^31 ints).
  __host__ __device__ __forceinline__ int list_at(int m_block, int bh_q) const {
    return (slice(bh_q) * num_m_blocks + m_block) * list_len;
  }
  // The bits of a row of a slice for one KV tile: four words, one per fragment column
  // group t, holding the visibility of keys 8j + 2t + e of the tile at bit 2j + e (the
  // 32 keys a consumer thread holds of that row).
  __host__ __device__ __forceinline__ int64_t tile_words(int slice, int row, int tile) const {
    return ((static_cast<int64_t>(slice) * num_m_blocks * groups::kKvTile + row) * (list_len - 1) +
            tile) * 4;
  }
};

// Hides the elements of a tile that the mask hides (they become kMaskedScore): for a
// cut tile one word per row of the thread (g, g + 8) holds its 32 bits of the tile (two
// loads, two registers live: the consumers have few to spare); a visible tile takes all
// ones, a hidden one all zeros. Then a shift and a LOP3 per element. row0: the thread's
// upper row in the sequence.
template <int kCols>
__device__ __forceinline__ void apply_attn_mask(int32_t (&s)[kCols], AttnMaskView m,
                                                int entry, int bh_q, common::FragCoord fc,
                                                int kv0, int row0) {
  const unsigned fill = entry & kMaskTileHidden ? 0u : ~0u;
  unsigned w[2] = {fill, fill};
  if (entry & kMaskTileCut) {
    const int slice = m.slice(bh_q), tile = kv0 / groups::kKvTile;
    w[0] = __ldg(m.bits + m.tile_words(slice, row0, tile) + fc.t);
    w[1] = __ldg(m.bits + m.tile_words(slice, row0 + 8, tile) + fc.t);
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    // Element i is row (i % 4) / 2, column 8 (i / 4) + 2t + i % 2: bit 2 (i / 4) + i % 2.
    // All ones where the bit is set: s stays; else kMaskedScore.
    const int keep = static_cast<int>(w[(i % 4) / 2] << (31 - (2 * (i / 4) + i % 2))) >> 31;
    s[i] = (s[i] & keep) | (scores::kMaskedScore & ~keep);
  }
}

// An additive attn_mask's values for one consumer thread of a cut tile, as
// OnlineSoftmax::step_additive asks for them: element i (even) and i + 1 are keys
// 8 (i / 4) + 2t and the next one of row (i % 4) / 2 of the thread (g, g + 8), one
// 4-byte word (the family's layout rule: keys contiguous, rows 4-byte aligned; a last
// odd key alone is a 2-byte load, so nothing past the row's last key is read). Rows past
// seqlen_q, keys past seqlen_kv and tiles that are not cut read nothing and add 0 (such
// keys are masked already). The caller issues every load() of a tile before it converts
// any word: a load used at once costs a memory round trip per pair (v51).
template <typename M>  // __half or __nv_bfloat16: the call's dtype
struct AdditivePairs {
  const uint16_t* row[2];  // the thread's rows at the tile's first key; null: nothing read
  int valid;               // keys of the tile below seqlen_kv
  int t;                   // the fragment's column group (lane % 4)
  bool cut;                // whether anything is read (a cut tile)

  // Whether both rows are read and the tile has all 128 keys: then every word is read
  // with no test, at a constant offset from the row (one instruction a word).
  __device__ __forceinline__ bool full() const {
    return row[0] != nullptr && row[1] != nullptr && valid >= 128;
  }
  // The raw word of elements i, i + 1 of a full() tile.
  __device__ __forceinline__ uint32_t load_full(int i) const {
    return __ldg(reinterpret_cast<const uint32_t*>(row[(i % 4) / 2] + 2 * t) + 4 * (i / 4));
  }
  // The raw word of elements i, i + 1 (0: adds +0 to both).
  __device__ __forceinline__ uint32_t load(int i) const {
    const int col = 8 * (i / 4) + 2 * t;
    const uint16_t* r = row[(i % 4) / 2];
    uint32_t w = 0;
    if (r != nullptr && col < valid)
      w = col + 1 < valid ? __ldg(reinterpret_cast<const uint32_t*>(r + col))
                          : static_cast<uint32_t>(__ldg(r + col));
    return w;
  }
  // Asks L2 for the thread's share of its rows in the next 128-key tile (the next entry
  // of a list in ascending order, for a bias under a causal or window rule): keys
  // 32t .. 32t + 31 of each row, two 32-byte sectors, none past seqlen_kv. A hint: no
  // register waits for it, so the next tile's loads find L2 instead of memory.
  __device__ __forceinline__ void prefetch_next() const {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int col = 128 + 32 * t + 16 * s;
        if (row[r] != nullptr && col < valid)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(row[r] + col));
      }
  }
  __device__ __forceinline__ static float2 pair(uint32_t w) {
    if constexpr (std::is_same_v<M, __nv_bfloat16>)
      return {__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)};
    else
      return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
};

// The pairs reader of tile kv0 for the thread whose upper row is row0 (a cut tile; else
// a reader of nothing).
template <typename M>
__device__ __forceinline__ AdditivePairs<M> additive_pairs(const AttnMaskView& m, bool cut,
                                                            int bh_q, int row0, int kv0,
                                                            int seqlen_q, int seqlen_kv, int t) {
  AdditivePairs<M> a{{nullptr, nullptr}, seqlen_kv - kv0, t, cut};
  if (!cut) return a;
  const int b = bh_q / m.heads_q, h = bh_q % m.heads_q;
  const uint8_t* base = m.data + b * m.stride_b + h * m.stride_h + int64_t{kv0} * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (row0 + 8 * r < seqlen_q)
      a.row[r] = reinterpret_cast<const uint16_t*>(base + int64_t{row0 + 8 * r} * m.stride_q);
  return a;
}

// Enqueues the classification of the mask's tiles and the lists (attn_mask_tiles.cu):
// `classes` is workspace of slices x num_m_blocks x (list_len - 1) bytes.
cudaError_t launch_attn_mask_tiles(const AttnMaskView& m, int seqlen_q, int seqlen_kv, int slices,
                                   uint8_t* classes, cudaStream_t stream);

}  // namespace qattn::sage2
