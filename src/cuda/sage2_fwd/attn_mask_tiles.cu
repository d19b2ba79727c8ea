// The pass that prepares a boolean attn_mask for the SA2-8b forward (attn_mask.cuh):
// every (slice, query block, KV tile) is classified from the caller's bytes, then each
// (slice, query block) gets its list of tiles with a visible key, in ascending order
// (the order the emulator and the FP64 reference take the tiles in).
#include <cuda_runtime.h>

#include "cuda/sage2_fwd/attn_mask.cuh"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {
namespace {

constexpr int kTile = groups::kKvTile;  // 128 keys; query blocks are 128 rows too
constexpr int kClassifyThreads = 256;
enum : uint8_t { kHidden = 0, kVisible = 1, kCut = 2 };

// One CTA per (KV tile, query block, slice): the tile's bits in the consumers' order
// (AttnMaskView::tile_words) and whether any element inside (seqlen_q, seqlen_kv) is
// visible and any hidden. A warp takes a row: its four ballots over 32 consecutive keys
// (one byte each) are the row's bits by key, which lanes 0-3 regroup per column group t.
// Bits outside (seqlen_q, seqlen_kv) are 0.
__global__ void __launch_bounds__(kClassifyThreads)
    classify_tiles(AttnMaskView m, int seqlen_q, int seqlen_kv, uint8_t* classes) {
  const int tile = blockIdx.x, m_block = blockIdx.y, slice = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = m.per_batch ? (m.per_head ? slice / m.heads_q : slice) : 0;
  const int h = m.per_head ? slice % m.heads_q : 0;
  const uint8_t* base = m.data + b * m.stride_b + h * m.stride_h;
  const int rows = min(kTile, seqlen_q - m_block * kTile);
  const int cols = min(kTile, seqlen_kv - tile * kTile);
  bool any_visible = false, any_hidden = false;
  for (int r = warp; r < kTile; r += kClassifyThreads / 32) {
    const int64_t row = int64_t{m_block} * kTile + r;
    unsigned by_key[kTile / 32];
#pragma unroll
    for (int q = 0; q < kTile / 32; ++q) {
      const int c = 32 * q + lane;
      const bool inside = r < rows && c < cols;
      const bool visible =
          inside && __ldg(base + row * m.stride_q + (int64_t{tile} * kTile + c) * m.stride_k) != 0;
      any_visible |= visible;
      any_hidden |= inside && !visible;
      by_key[q] = __ballot_sync(0xffffffffu, visible);
    }
    if (lane < 4) {  // t = lane: keys 8j + 2t + e at bit 2j + e
      unsigned word = 0;
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j)
        word |= ((by_key[j / 4] >> ((j % 4) * 8 + 2 * lane)) & 3u) << (2 * j);
      m.bits[m.tile_words(slice, static_cast<int>(row), tile) + lane] = word;
    }
  }
  any_visible = __syncthreads_or(any_visible);
  any_hidden = __syncthreads_or(any_hidden);
  if (threadIdx.x == 0)
    classes[(static_cast<int64_t>(slice) * gridDim.y + m_block) * gridDim.x + tile] =
        !any_visible ? kHidden : any_hidden ? kCut : kVisible;
}

// One warp per (query block, slice): the visible and cut tiles in order, a ballot per 32.
__global__ void __launch_bounds__(32) write_lists(AttnMaskView m, int kv_tiles,
                                                  const uint8_t* classes) {
  const int m_block = blockIdx.x, slice = blockIdx.y, lane = threadIdx.x;
  const int64_t at = static_cast<int64_t>(slice) * gridDim.x + m_block;
  const uint8_t* cls = classes + at * kv_tiles;
  int* list = const_cast<int*>(m.tiles) + at * m.list_len;
  int count = 0;
  for (int t0 = 0; t0 < kv_tiles; t0 += 32) {
    const int t = t0 + lane;
    const uint8_t c = t < kv_tiles ? cls[t] : kHidden;
    const unsigned keep = __ballot_sync(0xffffffffu, c != kHidden);
    if (c != kHidden)
      list[1 + count + __popc(keep & ((1u << lane) - 1u))] = t | (c == kCut ? kMaskTileCut : 0);
    count += __popc(keep);
  }
  if (lane == 0) {
    if (count == 0) list[1] = kMaskTileHidden;  // tile 0, every key hidden
    list[0] = count == 0 ? 1 : count;
  }
}

}  // namespace

cudaError_t launch_attn_mask_tiles(const AttnMaskView& m, int seqlen_q, int seqlen_kv, int slices,
                                   uint8_t* classes, cudaStream_t stream) {
  const int kv_tiles = m.list_len - 1;
  classify_tiles<<<dim3(kv_tiles, m.num_m_blocks, slices), kClassifyThreads, 0, stream>>>(
      m, seqlen_q, seqlen_kv, classes);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  write_lists<<<dim3(m.num_m_blocks, slices), 32, 0, stream>>>(m, kv_tiles, classes);
  return cudaGetLastError();
}

}  // namespace qattn::sage2
