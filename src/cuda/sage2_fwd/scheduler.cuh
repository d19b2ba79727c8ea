// The SA2-8b forward's scheduler: which work item each persistent CTA takes next.
//
// Work items are (128-row query block, query head, batch). The grid is persistent (one
// CTA per SM), so the producer loads the next item's Q and K/V while the consumers still
// finish the current one. CTA i starts with item i and then takes the next unclaimed
// item from a global counter (next_item): a static round-robin gave the CTAs of a causal
// grid sums of block lengths up to 18% apart at N=2K. The order of the items:
// common/work_order.h. One thread per CTA claims (the Q loader, producer.cuh); it
// publishes each claim, decoded, as a SlotItem for the other roles.
#pragma once

#include "cuda/common/work_order.h"
#include "cuda/sage2_fwd/traits.cuh"

namespace qattn::sage2 {

// gridDim.x, read where it is used: the producer warpgroup's 40 (or 24) registers cannot keep
// loop invariants live (the compiler would hoist and spill them).
__device__ __forceinline__ int grid_size() {
  int n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return n;
}

struct WorkItem {
  int m_block, hq, b;
};
// The non-causal path never computes B·Hq. The head's % and / are written once, after
// the choice: written in each path, the Q loader (its own function) kept both copies,
// one more integer division per claim.
__device__ __forceinline__ WorkItem decode_item(const AttentionParams& p, int item) {
  const common::ItemPlace at = !p.causal
                                   ? common::item_place(item, p.num_m_blocks, 0, false, 1, 0)
                                   : common::item_place(item, p.num_m_blocks, p.heads_q * p.batch,
                                                        true, p.causal_group, p.causal_tail);
  return {at.m_block, at.head % p.heads_q, at.head / p.heads_q};
}
// The claim of this CTA's work item number `local` (one thread per CTA).
__device__ __forceinline__ int next_item(const AttentionParams& p, int local) {
  return local == 0 ? static_cast<int>(blockIdx.x) : grid_size() + atomicAdd(&p.item_counter[0], 1);
}

// Called by each CTA's claiming thread after its last claim: the last CTA to get here
// puts the counters back to zero for the next launch (every claim of the grid is done by
// then).
__device__ __forceinline__ void release_item_counter(const AttentionParams& p) {
  __threadfence();  // this CTA's last claim comes before its count
  if (atomicAdd(&p.item_counter[1], 1) == grid_size() - 1) {
    p.item_counter[0] = 0;
    p.item_counter[1] = 0;
  }
}

// The key-padding length of batch entry b (seqlen_kv without lengths), clamped to
// [0, seqlen_kv] as qattn.h promises: one load per item, by the Q loader.
__device__ __forceinline__ int item_kv_len(const AttentionParams& p, int b) {
  if (p.kv_lengths == nullptr) return p.seqlen_kv;
  const int n = __ldg(p.kv_lengths + b);
  return n < 0 ? 0 : min(n, p.seqlen_kv);
}

// The KV tiles of a claimed item (SlotItem): the span its rows see (work_order.h). An
// item whose rows see no key (causal with Nq > Nkv, a window past the keys, a length
// of 0) still runs one tile, all of it masked: its rows come out O = 0 and LSE = -inf
// through the softmax (l = 0). So no item is empty, and while the consumers hold an
// item they wait on no item but the one after it: the Q slot and the 16-bit buffer of
// the later ones come free only with that item's output (an empty item, skipped,
// made them wait on one: a hang).
// With an attn_mask the tiles are the item's list (attn_mask.cuh): the loaders and the
// consumers count its entries instead of a span (it has at least one).
template <bool kAttnMask>
__device__ __forceinline__ common::TileSpan item_tiles(const AttentionParams& p,
                                                       const SlotItem& w) {
  if constexpr (kAttnMask) {
    const AttnMaskView m = p.mask;  // a copy: a kernel parameter's address would put p on the stack
    return {0, __ldg(m.tiles + m.list_at(w.m_block, w.bh_q))};
  }
  numerics::KeyRule rule = p.keys;
  rule.kv_len = w.kv_len;
  const common::TileSpan span = common::kv_tile_span(rule, p.seqlen_q, w.m_block);
  return span.count > 0 ? span : common::TileSpan{0, 1};
}

// The varlen kernel's items (varlen.cuh): the query heads in groups of
// p.causal_group whose K/V fit in L2 together (as the dense causal order's), and within
// a group the plan's list, longest first, each entry for every head of the group. So
// the grid ends on the last group's shortest blocks, and the items in flight share a
// group's K/V.
__device__ __forceinline__ WorkItem decode_varlen_item(const AttentionParams& p, int item,
                                                       int entries) {
  const int per_group = entries * p.causal_group;
  const int g = item / per_group, r = item % per_group;
  const int heads = min(p.causal_group, p.heads_q - g * p.causal_group);
  const int2 e = __ldg(p.varlen.entries + r / heads);
  return {e.y, g * p.causal_group + r % heads, e.x};
}

// The KV tiles of a varlen item: item_tiles with its sequence's rule.
__device__ __forceinline__ common::TileSpan varlen_item_tiles(const AttentionParams& p,
                                                              const SlotItem& w, int q_len) {
  const numerics::KeyRule rule = seq_rule(p.keys, q_len, w.kv_len, p.varlen.top_left != 0);
  const common::TileSpan span = common::kv_tile_span(rule, q_len, w.m_block);
  return span.count > 0 ? span : common::TileSpan{0, 1};
}

// b · Hkv + the KV head that query head hq reads (GQA: Hq / Hkv query heads per KV head).
__device__ __forceinline__ int kv_slice_of(const AttentionParams& p, const WorkItem& w) {
  return w.b * p.heads_kv + w.hq / (p.heads_q / p.heads_kv);
}

}  // namespace qattn::sage2
