// The pass that prepares an attn_mask for the SA2-8b forward (attn_mask.cuh): every
// (slice, query block, KV tile) is classified from the caller's bytes or values, then each
// (slice, query block) gets its list of tiles with a visible key, in ascending order
// (the order the emulator and the FP64 reference take the tiles in).
#include <cuda_runtime.h>

#include "cuda/sage2_fwd/attn_mask.cuh"
#include "numerics/additive_mask.h"
#include "numerics/mask_bits.h"
#include "numerics/mask_tiles.h"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {
namespace {

constexpr int kTile = groups::kKvTile;  // 128 keys; query blocks are 128 rows too
constexpr int kClassifyThreads = 256;
// Tile classes (numerics/mask_tiles.h): kVisible is a boolean tile with every key
// visible or an additive tile of zeros; the additive pass also gives kTileSaturated.
enum : uint8_t {
  kHidden = numerics::kTileHidden,
  kVisible = numerics::kTileUnchanged,
  kCut = numerics::kTileCut,
};

// Rows a warp reads before it looks at any of them: the pass is bound by how many bytes
// are in flight, and a ballot (or a flag) after each load would wait for that load
// (v51: one row at a time read the mask at 0.5-2 TB/s).
constexpr int kWarps = kClassifyThreads / 32;
constexpr int kRowsPerWarp = kTile / kWarps;  // 16
constexpr int kChunkRows = 4;                 // rows in flight per warp (additive: 256 B each)
constexpr int kBoolChunkRows = 16;            // boolean rows are 128 B: all of the warp's

// One CTA per (KV tile, query block, slice): the tile's bits in the consumers' order
// (AttnMaskView::tile_words) and whether any element inside (seqlen_q, seqlen_kv) is
// visible and any hidden. A warp takes rows warp + 8k: ballots over a row's 128 keys give
// its bits, which lanes 0-3 regroup per column group t. Bits outside (seqlen_q,
// seqlen_kv) are 0.
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
  // Rows of whole 4-byte words (keys contiguous, every row start 4-byte aligned, Nkv a
  // multiple of 4): a lane reads keys 4l .. 4l + 3 of the row in one load.
  const bool words = m.stride_k == 1 && seqlen_kv % 4 == 0 &&
                     ((reinterpret_cast<uintptr_t>(m.data) | m.stride_b | m.stride_h | m.stride_q) & 3) == 0;
  auto row_at = [&](int r) {
    return base + (int64_t{m_block} * kTile + r) * m.stride_q + int64_t{tile} * kTile * m.stride_k;
  };
  for (int c0 = 0; c0 < kRowsPerWarp; c0 += kBoolChunkRows) {
    if (words) {
      // Row warp + 8k of the tile is k row steps past row `warp`, for its words and for
      // its bits (tile_words is linear in the row): no 64-bit index math per row.
      const int64_t step = int64_t{kWarps} * m.stride_q / 4;
      const unsigned* in = reinterpret_cast<const unsigned*>(row_at(warp + kWarps * c0)) + lane;
      const int64_t bits_step = int64_t{kWarps} * (m.list_len - 1) * 4;
      unsigned* bits = m.bits + m.tile_words(slice, m_block * kTile + warp + kWarps * c0, tile) + lane;
      unsigned bytes[kBoolChunkRows];
#pragma unroll
      for (int k = 0; k < kBoolChunkRows; ++k) {
        const int r = warp + kWarps * (c0 + k);
        const bool inside = r < rows && 4 * lane < cols;  // cols is a multiple of 4 here
        bytes[k] = inside ? __ldg(in + k * step) : 0u;
      }
#pragma unroll
      for (int k = 0; k < kBoolChunkRows; ++k) {
        const int r = warp + kWarps * (c0 + k);
        const bool inside = r < rows && 4 * lane < cols;
        // The row's words per column group (numerics/mask_bits.h), one OR reduction each.
        const unsigned nz = numerics::visible_bytes(bytes[k]);
        any_visible |= nz != 0;
        any_hidden |= inside && nz != 0x01010101u;
        const unsigned w0 = __reduce_or_sync(0xffffffffu, numerics::lane_group_bits(nz, lane, 0));
        const unsigned w1 = __reduce_or_sync(0xffffffffu, numerics::lane_group_bits(nz, lane, 1));
        const unsigned w2 = __reduce_or_sync(0xffffffffu, numerics::lane_group_bits(nz, lane, 2));
        const unsigned w3 = __reduce_or_sync(0xffffffffu, numerics::lane_group_bits(nz, lane, 3));
        if (lane < 4) bits[k * bits_step] = lane == 0 ? w0 : lane == 1 ? w1 : lane == 2 ? w2 : w3;
      }
    } else {
#pragma unroll 1
      for (int k = 0; k < kBoolChunkRows; ++k) {
        const int r = warp + kWarps * (c0 + k);
        const uint8_t* at = row_at(r);
        unsigned by_key[kTile / 32];  // bit c: key 32q + c visible, a byte read per key
#pragma unroll
        for (int q = 0; q < kTile / 32; ++q) {
          const int c = 32 * q + lane;
          const bool inside = r < rows && c < cols;
          const bool visible = inside && __ldg(at + c * m.stride_k) != 0;
          any_visible |= visible;
          any_hidden |= inside && !visible;
          by_key[q] = __ballot_sync(0xffffffffu, visible);
        }
        unsigned word = 0;
#pragma unroll
        for (int j = 0; j < kTile / 8; ++j)
          word |= ((by_key[j / 4] >> ((j % 4) * 8 + 2 * lane)) & 3u) << (2 * j);
        if (lane < 4)
          m.bits[m.tile_words(slice, m_block * kTile + r, tile) + lane] = word;
      }
    }
  }
  any_visible = __syncthreads_or(any_visible);
  any_hidden = __syncthreads_or(any_hidden);
  if (threadIdx.x == 0)
    classes[(static_cast<int64_t>(slice) * gridDim.y + m_block) * gridDim.x + tile] =
        !any_visible ? kHidden : any_hidden ? kCut : kVisible;
}

// An additive mask's classes, one CTA per (KV tile, query block, slice) as above:
// hidden, unchanged, saturated or cut (numerics/mask_tiles.h). A lane reads a pair of
// keys as one 4-byte word (the family's layout rule), the last odd key of a row alone.
// Values are compared as bits (neg_inf is -inf's in the dtype); a bf16 value at or below
// kLowestAdditive is saturated (no fp16 value is). Once one thread's values prove the tile
// cut the CTA stops reading it (after each chunk of rows), so a tile of a bias is read in
// part and only hidden, unchanged and saturated tiles (and a cut no single thread sees,
// e.g. a boundary between a thread's zeros and another's -inf) are read whole.
__global__ void __launch_bounds__(kClassifyThreads)
    classify_additive_tiles(AttnMaskView m, int seqlen_q, int seqlen_kv, uint16_t neg_inf,
                            uint8_t* classes) {
  const int tile = blockIdx.x, m_block = blockIdx.y, slice = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = m.per_batch ? (m.per_head ? slice / m.heads_q : slice) : 0;
  const int h = m.per_head ? slice % m.heads_q : 0;
  const uint8_t* base = m.data + b * m.stride_b + h * m.stride_h + int64_t{tile} * kTile * 2;
  const int rows = min(kTile, seqlen_q - m_block * kTile);
  const int cols = min(kTile, seqlen_kv - tile * kTile);
  // What this thread's values showed (numerics/mask_tiles.h): whole words by the
  // two-value steps, a row's last odd key alone into `seen`.
  const uint32_t dead_lo = numerics::dead_lo_bits(m.bf16, neg_inf);
  numerics::AdditiveWordFacts facts(neg_inf, dead_lo);
  uint32_t seen = 0;
  bool cut = false;
  __shared__ uint32_t warp_seen[kWarps];
  // Rows warp + 8 (c0 + k), k < kChunkRows, as words; the next chunk's loads are issued
  // before this chunk is examined, so two chunks are in flight.
  auto load_chunk = [&](uint32_t (&w)[kChunkRows][2], int c0) {
#pragma unroll
    for (int k = 0; k < kChunkRows; ++k) {
      const int r = warp + kWarps * (c0 + k);
      const auto* row = reinterpret_cast<const uint16_t*>(
          base + (int64_t{m_block} * kTile + r) * m.stride_q);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = 2 * (32 * half + lane);  // keys c, c + 1
        w[k][half] = 0;
        if (r < rows && c + 1 < cols)
          w[k][half] = __ldg(reinterpret_cast<const uint32_t*>(row + c));
        else if (r < rows && c < cols)
          w[k][half] = __ldg(row + c);
      }
    }
  };
  uint32_t w[kChunkRows][2], next[kChunkRows][2];
  load_chunk(w, 0);
#pragma unroll
  for (int c0 = 0; c0 < kRowsPerWarp; c0 += kChunkRows) {
    if (c0 + kChunkRows < kRowsPerWarp) load_chunk(next, c0 + kChunkRows);
#pragma unroll
    for (int k = 0; k < kChunkRows; ++k) {
      const int r = warp + kWarps * (c0 + k);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = 2 * (32 * half + lane);
        if (r < rows && c + 1 < cols)
          facts.see_word(w[k][half]);
        else if (r < rows && c < cols)
          seen |= numerics::additive_value_flags(w[k][half] & 0xffffu, neg_inf, dead_lo);
      }
    }
    // One barrier a chunk: whether some thread's own values prove the tile cut (a cut
    // seen only across threads is found at the end, after the whole tile).
    if (__syncthreads_or(numerics::additive_cut_proven(seen | facts.flags()))) {
      cut = true;
      break;  // the same on every thread
    }
#pragma unroll
    for (int k = 0; k < kChunkRows; ++k) w[k][0] = next[k][0], w[k][1] = next[k][1];
  }
  uint8_t cls = kCut;
  if (!cut) {  // the CTA's facts: the warps' ORs through shared memory
    const uint32_t mine = __reduce_or_sync(0xffffffffu, seen | facts.flags());
    if (lane == 0) warp_seen[warp] = mine;
    __syncthreads();
    seen = 0;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) seen |= warp_seen[x];
    cls = numerics::additive_tile_class(seen);
  }
  if (threadIdx.x == 0)
    classes[(static_cast<int64_t>(slice) * gridDim.y + m_block) * gridDim.x + tile] = cls;
}

// One warp per (query block, slice): the visible and cut tiles in order, a ballot per 32.
__global__ void __launch_bounds__(32) write_lists(AttnMaskView m, int kv_tiles,
                                                  const uint8_t* classes) {
  const int m_block = blockIdx.x, slice = blockIdx.y, lane = threadIdx.x;
  const int64_t at = static_cast<int64_t>(slice) * gridDim.x + m_block;
  const uint8_t* cls = classes + at * kv_tiles;
  int* list = const_cast<int*>(m.tiles) + at * m.list_len;  // = m.list_at(...)
  // Whether some tile of the block is unchanged (then its saturated tiles are left out).
  bool unchanged = false;
  for (int t = lane; t < kv_tiles; t += 32) unchanged |= cls[t] == kVisible;
  unchanged = __any_sync(0xffffffffu, unchanged);
  int count = 0;
  for (int t0 = 0; t0 < kv_tiles; t0 += 32) {
    const int t = t0 + lane;
    const auto c = static_cast<numerics::MaskTileClass>(t < kv_tiles ? cls[t] : kHidden);
    const bool kept = numerics::list_keeps(c, unchanged);
    const unsigned keep = __ballot_sync(0xffffffffu, kept);
    if (kept)
      list[1 + count + __popc(keep & ((1u << lane) - 1u))] =
          t | (numerics::list_reads(c) ? kMaskTileCut : 0);
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
  const dim3 grid(kv_tiles, m.num_m_blocks, slices);
  if (m.additive)
    classify_additive_tiles<<<grid, kClassifyThreads, 0, stream>>>(
        m, seqlen_q, seqlen_kv, m.bf16 ? uint16_t{0xff80} : uint16_t{0xfc00}, classes);
  else
    classify_tiles<<<grid, kClassifyThreads, 0, stream>>>(m, seqlen_q, seqlen_kv, classes);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  write_lists<<<dim3(m.num_m_blocks, slices), 32, 0, stream>>>(m, kv_tiles, classes);
  return cudaGetLastError();
}

}  // namespace qattn::sage2
