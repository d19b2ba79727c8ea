// The SA2-8b forward's boolean attn_mask (qattn_fwd_params' attn_mask): how the kernel
// reads it. A pass before the attention kernel (attn_mask_tiles.cu) classifies every
// 128 x 128 tile of each query block and writes, per (mask slice, query block), the
// list of tiles that have a visible key; the loaders walk that list instead of a span
// of tiles, so hidden tiles are never loaded. Each entry says whether its tile is
// entirely visible (run as if unmasked) or cut (each element tested against the
// mask's bits, which the pass also writes: a bit per (row, key)).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

// Enqueues the classification of the mask's tiles and the lists (attn_mask_tiles.cu):
// `classes` is workspace of slices x num_m_blocks x (list_len - 1) bytes.
cudaError_t launch_attn_mask_tiles(const AttnMaskView& m, int seqlen_q, int seqlen_kv, int slices,
                                   uint8_t* classes, cudaStream_t stream);

}  // namespace qattn::sage2
