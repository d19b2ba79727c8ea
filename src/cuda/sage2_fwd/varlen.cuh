// The SA2-8b forward over a packed variable-length batch (qattn.h, cu_seqlens): how the
// kernels find each sequence. A plan pass (varlen_plan.cu) reads the offsets once and
// writes, in the workspace, each sequence's place (SeqPlace) and the list of its
// 128-row query blocks ordered by their KV tile count, longest first (the persistent
// grid then ends on the short ones). The K/V passes quantize each sequence into its own
// 128-aligned rows of the workspace (its K mean over its own keys), and the attention
// kernel walks the list for groups of query heads whose K/V fit in L2 (scheduler.cuh). Every rule of the dense kernel then
// applies per sequence, with Nq = len_q(b) and Nkv = len_k(b).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "numerics/key_range.h"

namespace qattn::sage2 {

// Where sequence b lies (32 bytes, two 16-byte loads).
struct alignas(16) SeqPlace {
  int q_start, q_len;  // its query rows in the packed q and o
  int k_start, k_len;  // its keys in the packed k and v
  int kv_row0;         // its first row in the workspace's K/V (a multiple of 128)
  int unused[3];
};

// The plan as the kernels read it; seqs is null in a dense call.
struct VarlenView {
  const SeqPlace* seqs;
  const int2* entries;     // (sequence, query block), longest first
  const int* entry_count;  // the list's length (at most the workspace's bound)
  int top_left;            // the diagonal's alignment per sequence (key_range.h)
  int total_q;             // packed query rows (the LSE's row stride)
};

// The key rule of sequence `s` from the call's rule (its window sides and causal): the
// sequence's keys and its own diagonal.
__host__ __device__ __forceinline__ numerics::KeyRule seq_rule(numerics::KeyRule rule, int q_len,
                                                               int k_len, bool top_left) {
  rule.kv_len = k_len;
  rule.offset = top_left ? 0 : k_len - q_len;
  return rule;
}

// Enqueues the plan: reads cu_seqlens_q/k (batch + 1 each), clamps them (every offset
// to [0, total], every start to at least the one before it, every length to the call's
// max), and writes `seqs` (batch entries), `entries` (at most max_entries) and
// `entry_count`. One CTA.
cudaError_t launch_varlen_plan(const int* cu_seqlens_q, const int* cu_seqlens_k, int batch,
                               int total_q, int total_k, int max_seqlen_q, int max_seqlen_k,
                               numerics::KeyRule rule, bool top_left, int max_entries,
                               SeqPlace* seqs, int2* entries, int* entry_count,
                               cudaStream_t stream);

}  // namespace qattn::sage2
