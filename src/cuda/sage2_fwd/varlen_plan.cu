// The plan of a packed variable-length SA2-8b forward (varlen.cuh): each sequence's
// place, and its query blocks in one list ordered by KV tile count, longest first.
// One CTA of 1024 threads: the pass reads 2·(batch + 1) ints and writes a few per
// query block; a counting sort by tile count needs no global synchronization.
#include <cub/block/block_scan.cuh>

#include "cuda/common/work_order.h"
#include "cuda/sage2_fwd/varlen.cuh"
#include "numerics/mma_groups.h"

namespace qattn::sage2 {
namespace {

constexpr int kThreads = 1024;
// Tile counts are sorted in this many bins; longer items (past 1M keys) share the last.
constexpr int kBins = 8192;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kRows = common::kItemRows, kTile = groups::kKvTile;

using Scan = cub::BlockScan<int, kThreads>;

struct MaxOp {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// The visible KV tiles of query block m of a sequence: its sort key (at least 1: a
// block whose rows see no key still runs one masked tile).
__device__ int block_tiles(const numerics::KeyRule& rule, int q_len, int m) {
  const common::TileSpan span = common::kv_tile_span(rule, q_len, m);
  const int n = span.count > 0 ? span.count : 1;
  return n < kBins ? n : kBins - 1;
}

__global__ void __launch_bounds__(kThreads)
    varlen_plan_kernel(const int* cu_q, const int* cu_k, int batch, int total_q, int total_k,
                       int max_q, int max_k, numerics::KeyRule rule, int top_left, int max_entries,
                       SeqPlace* seqs, int2* entries, int* entry_count) {
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[kBins];
  __shared__ int carry[3];  // running max of the q and k offsets, running K/V rows
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  if (threadIdx.x == 0) carry[0] = carry[1] = carry[2] = 0;
  __syncthreads();

  // 1. Places, in chunks of kThreads sequences. A sequence's start is the running max of
  // the clamped offsets before it, so sequences never overlap and their lengths sum to
  // at most the totals whatever the arrays hold.
  for (int b0 = 0; b0 < batch; b0 += kThreads) {
    const int b = b0 + static_cast<int>(threadIdx.x);
    const bool in = b < batch;
    auto clamped = [](const int* cu, int i, int total) {
      const int x = __ldg(cu + i);
      return x < 0 ? 0 : (x > total ? total : x);
    };
    // Offsets past the batch read as the running end (they change nothing).
    const int q_end_raw = in ? clamped(cu_q, b + 1, total_q) : 0;
    const int k_end_raw = in ? clamped(cu_k, b + 1, total_k) : 0;
    int q_start, k_start;
    Scan(scan).ExclusiveScan(q_end_raw, q_start, max(carry[0], clamped(cu_q, 0, total_q)), MaxOp{});
    __syncthreads();
    Scan(scan).ExclusiveScan(k_end_raw, k_start, max(carry[1], clamped(cu_k, 0, total_k)), MaxOp{});
    __syncthreads();
    const int q_end = max(q_start, q_end_raw), k_end = max(k_start, k_end_raw);
    const int q_len = in ? min(q_end - q_start, max_q) : 0;
    const int k_len = in ? min(k_end - k_start, max_k) : 0;
    // At least one tile: a sequence without keys keeps a tile of zeros that its masked
    // rows read (quantize.cu).
    const int kv_rows = max(1, (k_len + kTile - 1) / kTile) * kTile;
    int kv_row0, chunk_rows;
    Scan(scan).ExclusiveSum(kv_rows, kv_row0, chunk_rows);
    kv_row0 += carry[2];
    if (in) seqs[b] = SeqPlace{q_start, q_len, k_start, k_len, kv_row0, {0, 0, 0}};
    // 2. The histogram of the sequence's blocks by tile count.
    const numerics::KeyRule r = seq_rule(rule, q_len, k_len, top_left != 0);
    for (int m = 0; m < (q_len + kRows - 1) / kRows; ++m) atomicAdd(&hist[block_tiles(r, q_len, m)], 1);
    __syncthreads();  // every thread has read carry
    if (threadIdx.x == kThreads - 1) {
      carry[0] = q_end;
      carry[1] = k_end;
      carry[2] += chunk_rows;
    }
    __syncthreads();
  }

  // 3. Each bin's first position, longest first: bins kBins - 1 .. 1 in that order.
  int counts[kBinsPerThread], total = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    counts[i] = hist[kBins - 1 - (threadIdx.x * kBinsPerThread + i)];
    total += counts[i];
  }
  int before, all;
  Scan(scan).ExclusiveSum(total, before, all);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    hist[kBins - 1 - (threadIdx.x * kBinsPerThread + i)] = before;
    before += counts[i];
  }
  if (threadIdx.x == 0) *entry_count = min(all, max_entries);
  __syncthreads();

  // 4. The entries. Within a bin the order is the atomics' (any order gives the same
  // output: items are independent).
  for (int b = threadIdx.x; b < batch; b += kThreads) {
    const SeqPlace s = seqs[b];
    const numerics::KeyRule r = seq_rule(rule, s.q_len, s.k_len, top_left != 0);
    for (int m = 0; m < (s.q_len + kRows - 1) / kRows; ++m) {
      const int at = atomicAdd(&hist[block_tiles(r, s.q_len, m)], 1);
      if (at < max_entries) entries[at] = make_int2(b, m);
    }
  }
}

}  // namespace

cudaError_t launch_varlen_plan(const int* cu_seqlens_q, const int* cu_seqlens_k, int batch,
                               int total_q, int total_k, int max_seqlen_q, int max_seqlen_k,
                               numerics::KeyRule rule, bool top_left, int max_entries,
                               SeqPlace* seqs, int2* entries, int* entry_count,
                               cudaStream_t stream) {
  varlen_plan_kernel<<<1, kThreads, 0, stream>>>(cu_seqlens_q, cu_seqlens_k, batch, total_q,
                                                 total_k, max_seqlen_q, max_seqlen_k, rule,
                                                 top_left ? 1 : 0, max_entries, seqs, entries,
                                                 entry_count);
  return cudaGetLastError();
}

}  // namespace qattn::sage2
